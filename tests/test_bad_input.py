"""Bad input at the CLI: every input of issue 12's list gets a one-line error and exit 2, loses nothing
already done, and never resolves a task name as a path or writes outside --output."""

import json
import re
import shutil

import pytest

from melt_eval.evaluation import RunPaths, run_tasks
from melt_eval.generation.options import InferenceOptions, Sampling

from helpers import main_exit_code as _main
from helpers import one_line_error as _one_line_error

TINY_RUN = ["--max-problems", "2", "--samples", "2", "--max-new-tokens", "4", "--no-progress"]


# --- data, completions and config files that cannot be read ----------------------------------------

NESTED = "[" * 100_000 + "]" * 100_000
FILE_CONTENTS = {  # what a data or completions file holds -> what the error says
    "non-utf8": (b'{"problem": "caf\xe9", "answer": "1"}\n', "not UTF-8"),
    "deeply-nested": (NESTED.encode() + b"\n", "nested too deeply"),
    "nested-object": (('{"problem": ' + "[" * 70 + "1" + "]" * 70 + ', "answer": "1"}\n').encode(), "nested more than"),
    "lone-surrogate": (b'{"problem": "x \\ud800 y", "answer": "1", "index": 0, "completions": ["\\udc00"]}\n',
                       "lone surrogate"),
    "a-list": (b'[1, 2]\n', "is not a JSON object"),
}


@pytest.mark.parametrize("case", FILE_CONTENTS)
def test_bad_data_file(tmp_path, capsys, case):
    content, message = FILE_CONTENTS[case]
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "aime24.jsonl").write_bytes(content)
    out = tmp_path / "out"
    code = _main(["run", "aime24", "--model", "tiny-random-melt", "--data-dir", tmp_path / "data", "--output", out, *TINY_RUN])
    _one_line_error(capsys, code, "aime24.jsonl", message)
    assert not out.exists()


@pytest.mark.parametrize("case", FILE_CONTENTS)
def test_bad_completions_file(tmp_path, capsys, case):
    content, message = FILE_CONTENTS[case]
    (tmp_path / "c.jsonl").write_bytes(content)
    _one_line_error(capsys, _main(["score", "synthetic", "--completions", tmp_path / "c.jsonl"]), "c.jsonl", message)


@pytest.mark.parametrize(
    "args, message",
    [
        (["score", "synthetic", "--completions", "{dir}"], "is a directory"),
        (["score", "synthetic", "--completions", "{good}", "--details", "{dir}"], "--details"),
        (["run", "aime24", "--model", "tiny-random-melt", "--data-dir", "{datadir}", "--output", "{tmp}/o"],
         "aime24.jsonl is a directory"),
        (["run", "synthetic", "--model", "tiny-random-melt", "--output", "{file}"], "is a file, not a directory"),
        (["run", "synthetic", "--model", "tiny-random-melt", "--output", "{file}/sub"], "is a file, not a directory"),
        (["run", "synthetic", "--model", "tiny-random-melt", "--output", "{tmp}", "--name", "file"],
         "is a file, where"),
        (["train", "--recipe", "tiny-phase1", "--from", "tiny-random-ouro", "--output", "{file}"], "is a file"),
        (["train", "--recipe", "tiny-phase1", "--from", "tiny-random-ouro", "--output", "{tmp}/t", "--config", "{dir}"],
         "is a directory"),
    ],
)
def test_a_directory_where_a_file_is_expected_and_back(tmp_path, capsys, args, message):
    (tmp_path / "dir").mkdir()
    (tmp_path / "datadir" / "aime24.jsonl").mkdir(parents=True)
    (tmp_path / "file").write_text("not a directory\n")
    (tmp_path / "good.jsonl").write_text(json.dumps({"index": 0, "completions": ["\\boxed{1}"]}) + "\n")
    names = dict(dir=tmp_path / "dir", datadir=tmp_path / "datadir", file=tmp_path / "file",
                 good=tmp_path / "good.jsonl", tmp=tmp_path)
    args = [a.format(**names) for a in args]
    if args[0] == "run":
        args += TINY_RUN
    _one_line_error(capsys, _main(args), message)
    assert (tmp_path / "file").read_text() == "not a directory\n"
    assert not (tmp_path / "t").exists() and not (tmp_path / "o").exists()


# --- recipe values with their types ----------------------------------------------------------------

@pytest.mark.parametrize(
    "extra, message",
    [
        (["--set", "adam_betas=5"], "adam_betas"),
        (["--set", "adam_betas=[0.9, 2]"], "adam_betas must be two numbers in [0, 1)"),
        (["--set", "micro_batch_size=2.5"], "micro_batch_size expects a whole number, got 2.5"),
        (["--set", "seed=-1"], "seed must be >= 0, got -1"),
        (["--set", "seed=abc"], "seed expects int"),
        (["--set", "lr=!!python/object/apply:os.system ['true']"], "--set lr"),
        (["--set", "kd_temperature=inf"], "kd_temperature expects a finite number"),
        (["--set", "kd_temperature=.nan"], "kd_temperature expects a finite number"),
        (["--set", "warmup_steps=1.5"], "warmup_steps expects a whole number, got 1.5"),
        (["--set", "data=5"], "data expects a list"),
        (["--set", "teacher=5"], "teacher expects a string"),
        (["--config", "{yaml_float}"], "warmup_steps expects a whole number, got 1.5"),
        (["--config", "{yaml_latin1}"], "not UTF-8"),
        (["--config", "{yaml_twice}"], "the key 'max_steps' is given twice at line 2"),
        (["--set", "data=[{{source: synthetic, n: 4, n: 8}}]"], "the key 'n' is given twice"),
        (["--set", "ema_decay=2"], "ema_decay must be within [0, 1]"),
    ],
)
def test_wrongly_typed_recipe_values(tmp_path, capsys, extra, message):
    (tmp_path / "float.yaml").write_text("warmup_steps: 1.5\n")
    (tmp_path / "latin1.yaml").write_bytes("gate: \"\xe9l\xe9mentwise\"\n".encode("latin-1"))
    (tmp_path / "twice.yaml").write_text("max_steps: 3\nmax_steps: 2\n")  # YAML itself would keep the last silently
    extra = [e.format(yaml_float=tmp_path / "float.yaml", yaml_latin1=tmp_path / "latin1.yaml",
                      yaml_twice=tmp_path / "twice.yaml") for e in extra]
    out = tmp_path / "train"
    code = _main(["train", "--recipe", "tiny-phase1", "--from", "tiny-random-ouro", "--output", out, "--no-progress", *extra])
    _one_line_error(capsys, code, message)
    assert not out.exists()


# --- options -----------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "args, message",
    [
        (["run", ",", "--model", "tiny-random-melt"], "no task given"),
        (["run", " , ", "--model", "tiny-random-melt"], "no task given"),
        (["run", "synthetic", "--model", "tiny-random-melt", "--name", "../../x"], "--name '../../x' must be a plain"),
        (["run", "synthetic", "--model", "tiny-random-melt", "--name", "a/b"], "must be a plain directory name"),
        (["run", "synthetic", "--model", "tiny-random-melt", "--name", ".."], "must be a plain directory name"),
        (["run", "synthetic", "--model", "tiny-random-melt", "--name", "a\nb"], "must be printable and at most 255"),
        (["run", "synthetic", "--model", "tiny-random-melt", "--share-prompt"], "MELT shares every entry across its loops"),
        (["run", "synthetic", "--model", "{tmp}/weights.safetensors"], "is a file, not a checkpoint directory"),
        (["run", "synthetic", "--model", "tiny-random-melt", "--max-concurrency", "0"], "--max-concurrency goes with --backend endpoint"),
        (["run", "synthetic", "--model", "tiny-random-melt", "--name", "a" * 300], "must be printable and at most 255"),
        (["report", "--results", "{tmp}", "--output", "{tmp}/r", "--plot-task", "nosuch"], "--plot-task 'nosuch' is not a task"),
    ],
)
def test_bad_options(tmp_path, capsys, args, message):
    (tmp_path / "weights.safetensors").write_bytes(b"")
    args = [a.format(tmp=tmp_path) for a in args]
    if args[0] == "run":
        args += ["--output", tmp_path / "out", *TINY_RUN]
    _one_line_error(capsys, _main(args), message)
    assert not (tmp_path / "out").exists() and not (tmp_path / "r").exists()
    assert not list(tmp_path.parent.glob("x"))


# --- the run's own files: resume store, results --------------------------------------------------------

@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """One small run, finished; tests copy it."""
    out = tmp_path_factory.mktemp("run")
    run_tasks("synthetic", "tiny-random-ouro", InferenceOptions(sampling=Sampling(samples=2, max_new_tokens=4)),
              RunPaths(output=out), max_problems=3, progress=False)
    return out / "tiny-random-ouro" / "synthetic"


def _copy_run(finished_run, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(finished_run, out / "tiny-random-ouro" / "synthetic")
    return out, out / "tiny-random-ouro" / "synthetic"


def _rerun(out):
    return _main(["run", "synthetic", "--model", "tiny-random-ouro", "--output", out, "--max-problems", "3",
                  "--samples", "2", "--max-new-tokens", "4", "--no-progress"])


@pytest.mark.parametrize("bad_line", ['{"completions": ["a", "b"], "tokens": 2}', "[1, 2, 3]", '{"key": 5}',
                                      "not json at all", '{"key": "k", "completions": "ab", "tokens": 1}'])
def test_bad_resume_store_line_is_reported_and_nothing_is_discarded(finished_run, tmp_path, capsys, bad_line):
    out, task_dir = _copy_run(finished_run, tmp_path)
    (task_dir / "results.json").unlink()  # an unfinished run, to be resumed
    store = task_dir / "completions.jsonl"
    lines = store.read_text().splitlines(keepends=True)
    damaged = lines[0] + bad_line + "\n" + "".join(lines[1:])
    store.write_text(damaged)
    err = _one_line_error(capsys, _rerun(out), f"{store}:2", "delete that line")
    assert "--force" not in err
    assert store.read_text() == damaged  # the finished problems are all still there


def test_a_store_line_with_too_few_samples_is_generated_again(finished_run, tmp_path):
    out, task_dir = _copy_run(finished_run, tmp_path)
    (task_dir / "results.json").unlink()
    store = task_dir / "completions.jsonl"
    rows = [json.loads(line) for line in store.read_text().splitlines()]
    rows[0]["completions"] = rows[0]["completions"][:1]  # 1 of 2 samples
    store.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert _rerun(out) == 0
    details = [json.loads(line) for line in (task_dir / "details.jsonl").read_text().splitlines()]
    assert all(len(d["completions"]) == 2 for d in details)
    assert (task_dir / "details.jsonl").read_text() == (finished_run / "details.jsonl").read_text()


@pytest.mark.parametrize("finished", ['"no"', '"yes"', "1", "null"])
def test_finished_must_be_true(finished_run, tmp_path, finished):
    from melt_eval.evaluation.runner import read_finished

    out, task_dir = _copy_run(finished_run, tmp_path)
    text = (task_dir / "results.json").read_text().replace('"finished": true', f'"finished": {finished}')
    (task_dir / "results.json").write_text(text)
    assert read_finished(task_dir) is None


# --- report --------------------------------------------------------------------------------------------

def _result(model, task, value=0.5, **extra):
    r = {"model": model, "task": task, "finished": True, "metrics": {"accuracy": {"value": value, "stderr": 0.01}},
         "settings": {"samples": 1, "loops": 4}, "num_problems": 10}
    r.update(extra)
    return r


MALFORMED = {
    "huge-value": json.dumps(_result("m2", "math500", value=1e308)).encode(),
    "nan-value": json.dumps(_result("m3", "math500", value=float("nan"))).encode(),
    "negative-stderr": json.dumps(_result("m4", "math500") | {"metrics": {"accuracy": {"value": 0.5, "stderr": -5}}}).encode(),
    "a-list": b"[1, 2]",
    "metrics-a-list": json.dumps(_result("m5", "math500") | {"metrics": [1]}).encode(),
    "value-a-string": json.dumps(_result("m6", "math500") | {"metrics": {"accuracy": {"value": "high"}}}).encode(),
    # dropped unread before: the claims and tables said "not run" of a damaged result
    "metric-a-string": json.dumps(_result("m9", "math500") | {"metrics": {"accuracy": "NaN"}}).encode(),
    "metric-without-value": json.dumps(_result("m10", "math500") | {"metrics": {"accuracy": {"stderr": 0.01}}}).encode(),
    "non-utf8": b'{"model": "caf\xe9"}',
    "deeply-nested": NESTED.encode(),
    "finished-no": json.dumps(_result("m7", "math500", finished="no")).encode(),
    "cut": b'{"model": "m8", "metr',
}


@pytest.mark.parametrize("case", MALFORMED)
def test_report_skips_a_malformed_results_file_with_a_note(tmp_path, capsys, case):
    root = tmp_path / "results"
    (root / "good" / "math500").mkdir(parents=True)
    (root / "good" / "math500" / "results.json").write_text(json.dumps(_result("good", "math500", value=0.625)))
    (root / "bad" / "math500").mkdir(parents=True)
    bad = root / "bad" / "math500" / "results.json"
    bad.write_bytes(MALFORMED[case])
    code = _main(["report", "--results", root, "--output", tmp_path / "r", "--no-plots", "--markdown"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert str(bad) in captured.out  # the note names the skipped file
    report = (tmp_path / "r" / "report.md").read_text()
    assert "62.5" in report  # the good run is reported
    assert not re.search(r"\binf\b|\bnan\b|± -", report, re.IGNORECASE)  # no `inf ± -500.0`


# --- task names are names; results stay under --output -------------------------------------------------

def test_task_names_are_never_read_as_paths(finished_run, tmp_path, monkeypatch):
    work = tmp_path / "cwd"
    (work / "synthetic").mkdir(parents=True)  # a folder named like the task
    (work / "synthetic|0").write_text("aime24\n")  # and a file named like LightEval's task string
    monkeypatch.chdir(work)
    out, _ = _copy_run(finished_run, tmp_path)
    (out / "tiny-random-ouro" / "synthetic" / "results.json").unlink()  # LightEval runs again on the saved completions
    assert _rerun(out) == 0
    result = json.loads((out / "tiny-random-ouro" / "synthetic" / "results.json").read_text())
    assert result["task"] == "synthetic" and result["finished"] is True
    details = tmp_path / "d.jsonl"
    assert _main(["score", "synthetic", "--completions", out / "tiny-random-ouro" / "synthetic" / "details.jsonl",
                  "--details", details]) == 0
    assert details.exists()


def test_model_dot_runs_under_the_checkpoint_directory_name(tmp_path, monkeypatch):
    from melt_eval.modeling.loading import resolve_model_dir

    ckpt = tmp_path / "my-ckpt"
    shutil.copytree(resolve_model_dir("tiny-random-melt"), ckpt)
    monkeypatch.chdir(ckpt)
    out = tmp_path / "out"
    assert _main(["run", "synthetic", "--model", ".", "--output", out, "--max-problems", "1", "--samples", "1",
                  "--max-new-tokens", "2", "--no-progress"]) == 0
    assert (out / "my-ckpt" / "synthetic" / "results.json").is_file()
    assert [p.relative_to(out).parts[0] for p in out.rglob("results.json")] == ["my-ckpt"]


def test_a_seed_out_of_range_is_refused_before_any_sample_is_generated(tmp_path, capsys):
    """LightEval refuses a negative seed only when it saves its outputs, after every sample: the harness refuses
    it first, at the flag and in the Python API's Sampling."""
    out = tmp_path / "out"
    assert _main(["run", "synthetic", "--model", "tiny-random-melt", "--seed", "-5", "--output", out, *TINY_RUN]) == 2
    assert "greater than or equal to 0" in capsys.readouterr().err  # typer's own refusal of the flag
    assert not out.exists()
    for seed in (-1, 2**62, 2**70):  # past 2**62 a seed would draw another seed's samples (problem_seed)
        with pytest.raises(Exception, match=rf"--seed must be a whole number from 0 to 2\*\*62 - 1, got {seed}"):
            Sampling(seed=seed)
    Sampling(seed=2**62 - 1)
    with pytest.raises(Exception, match=r"from 0 to"):
        run_tasks("synthetic", "tiny-random-melt", InferenceOptions(sampling=Sampling(samples=2, seed=-3)),
                  RunPaths(results_dir=out), max_problems=1, progress=False)
    assert not out.exists()


@pytest.mark.parametrize("command", [["demo", "--quick"], ["ablate", "gates", "--preset", "tiny"]])
def test_more_jobs_than_cores_are_refused_before_anything_runs(tmp_path, capsys, command):
    """Each job is a one-thread process with its own torch: a typo's thousand would exhaust the memory."""
    from melt_eval.experiments.ablations import usable_cores

    out = tmp_path / "out"
    too_many = usable_cores() + 1
    code = _main([*command, "--jobs", str(too_many), "--output", out, "--no-progress"])
    _one_line_error(capsys, code, f"--jobs {too_many} is more than the {usable_cores()} core")
    assert not out.exists() and not (tmp_path / "runs").exists()


@pytest.mark.parametrize("flag", ["--max-steps", "--samples", "--max-problems", "--max-new-tokens"])
def test_ablate_refuses_a_zero_it_would_have_read_as_not_given(tmp_path, capsys, flag):
    """`ablate --max-steps 0` planned the uncapped recipe (0 read as "not given"): refused, as `run` refuses it."""
    code = _main(["ablate", "gates", "--preset", "tiny", "--dry-run", flag, "0", "--runs", tmp_path / "runs",
                  "--output", tmp_path / "out"])
    err = capsys.readouterr().err
    err = " ".join(err.replace("│", " ").split())  # typer's own refusal, in a box that may wrap its line
    assert code == 2 and flag in err and "greater than or equal to 1" in err, err
    assert not (tmp_path / "runs").exists() and not (tmp_path / "out").exists()


# --- issue 69 item 9: what the flags and config.json can tell is refused before any weight (or torch) loads ----

LIGHT_REFUSALS = [  # run options on tiny-random-melt -> what the one line names
    (["--exit", "bogus"], "--exit must be gate:Q"),
    (["--name", "../x"], "must be a plain directory name"),
    (["--cross-loop-kv"], "--cross-loop-kv compresses Ouro's per-loop cache"),  # MELT's cache is shared
    (["--kv-sharing", "last"], "MELT always shares its KV cache"),
]


@pytest.mark.parametrize("args, message", LIGHT_REFUSALS, ids=[a[0] for a, _ in LIGHT_REFUSALS])
def test_run_refuses_what_the_flags_and_the_registry_say_before_torch_loads(tmp_path, args, message):
    import subprocess
    import sys

    out = tmp_path / "out"
    argv = ["run", "synthetic", "--model", "tiny-random-melt", "--output", str(out), *TINY_RUN, *args]
    code = ("import sys\nfrom melt_eval.cli import main\n"
            f"sys.argv = ['melt-eval', *{argv!r}]\n"
            "try:\n    main()\nexcept SystemExit as exc:\n    code = exc.code\n"
            "print(code, sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'lighteval')))\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.stdout.strip() == "2 []", run.stdout + run.stderr[-2000:]  # refused before the 10-20 s of imports
    err = run.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], run.stderr
    assert not out.exists()


def _tiny_dir(tmp_path, name: str, **config) -> str:
    from melt_eval.modeling.loading import resolve_model_dir

    model = tmp_path / name
    shutil.copytree(resolve_model_dir(name), model)
    fields = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**fields, **config}))
    return str(model)


def test_a_checkpoint_directorys_config_answers_for_its_cache_before_it_loads(tmp_path, capsys, monkeypatch):
    from melt_eval import modeling

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before its options were checked against its config")

    monkeypatch.setattr(modeling, "load_model", no_load)
    ouro = _tiny_dir(tmp_path, "tiny-random-ouro")
    code = _main(["run", "synthetic", "--model", ouro, "--kv-sharing", "last", "--share-prompt", "--cross-loop-kv",
                  "--output", tmp_path / "out", *TINY_RUN])
    _one_line_error(capsys, code, "--cross-loop-kv compresses Ouro's per-loop cache")
    code = _main(["run", "synthetic", "--model", ouro, "--loops", "1", "--cross-loop-kv", "--output", tmp_path / "out",
                  *TINY_RUN])
    _one_line_error(capsys, code, "loops >= 2")
    assert not (tmp_path / "out").exists()


def test_a_config_too_large_for_this_machine_is_one_line_before_any_weight_is_allocated(tmp_path, capsys):
    huge = _tiny_dir(tmp_path, "tiny-random-ouro", hidden_size=10**9)  # weights of 2 TB and more
    fragments = ("describes a model of at least", "more than this machine's", "check hidden_size")
    code = _main(["run", "synthetic", "--model", huge, "--output", tmp_path / "out", *TINY_RUN])
    _one_line_error(capsys, code, "config.json", *fragments)
    assert not (tmp_path / "out").exists()
    code = _main(["train", "--recipe", "tiny-phase1", "--from", huge, "--output", tmp_path / "t", "--no-progress"])
    _one_line_error(capsys, code, *fragments)
    code = _main(["train", "--recipe", "pretrain-tiny", "--from", "tiny-random-ouro", "--output", tmp_path / "p",
                  "--no-progress", "--set", "model_overrides={hidden_size: 1000000000}"])
    _one_line_error(capsys, code, "with model_overrides", *fragments)
    assert not any((tmp_path / d / "recipe.yaml").exists() for d in ("t", "p"))


@pytest.mark.parametrize("args, message", [
    (["--recipe", "tiny-phase2", "--from", "tiny-random-ouro"], "is a LoopLM (run phase 1 first)"),
    (["--recipe", "tiny-phase2", "--from", "tiny-random-melt", "--teacher", "tiny-random-ouro", "--set", "kv_heads=1"],
     "MELT checkpoint with 2 key/value"),
    (["--recipe", "tiny-phase2", "--from", "tiny-random-melt"], "no recorded teacher"),
], ids=["phase2-from-looplm", "kv-heads-of-a-melt", "no-teacher"])
def test_train_refuses_what_the_starting_models_config_says_before_it_loads(tmp_path, capsys, monkeypatch, args, message):
    from melt_eval import modeling

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before its config was checked")

    monkeypatch.setattr(modeling, "load_model", no_load)
    code = _main(["train", *args, "--output", tmp_path / "t", "--no-progress"])
    _one_line_error(capsys, code, message)
    assert not (tmp_path / "t" / "recipe.yaml").exists()
