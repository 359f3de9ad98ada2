"""Issue 41's hostile evaluation inputs, kept as fixtures: files that are not regular files (FIFOs, devices,
directories, symlink loops, files over the size limit), damaged or self-contradicting checkpoints, results
files of the wrong types, output paths through a file, a full disk, allocations beyond memory. Each is one
line on stderr and exit 2 (or, for a report, a one-line note), never a hang or a traceback; and a run
interrupted and resumed reports what an uninterrupted one does."""

import errno
import json
import math
import os
import shutil
import signal
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from melt_eval.evaluation import RunPaths, run_tasks
from melt_eval.generation.options import InferenceOptions, Sampling

from helpers import copy_checkpoint as _copy
from helpers import refused_load as _refused
from helpers import main_exit_code as _main
from helpers import one_line_error as _one_line_error

TINY_RUN = ["--max-problems", "1", "--samples", "1", "--max-new-tokens", "2", "--no-progress"]


@pytest.fixture(autouse=True)
def no_hang():
    """A FIFO opened for reading blocks until a writer comes: turn a hang into a failure after 120 s."""
    def hung(*_):
        raise TimeoutError("hung: a file that is not a regular file was opened")

    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(120)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


# --- files that are not regular files --------------------------------------------------------------

def _fifo(path):
    os.mkfifo(path)
    return path


def _sparse(path, size):
    with open(path, "wb") as f:  # takes no disk space: only its size is read
        f.truncate(size)
    return path


DATA_FILES = {  # what --data-dir's aime24.jsonl is -> what the error says
    "fifo": (_fifo, "is a FIFO"),
    "dev-zero": (lambda p: os.symlink("/dev/zero", p), "is a device"),
    "symlink-loop": (lambda p: os.symlink(p.name, p), "cannot read"),
    "over-1-GiB": (lambda p: _sparse(p, (1 << 30) + 1), "more than the 1024 MiB limit"),
}


@pytest.mark.parametrize("case", DATA_FILES)
def test_a_data_file_that_is_not_a_regular_file(tmp_path, capsys, case):
    make, message = DATA_FILES[case]
    (tmp_path / "data").mkdir()
    make(tmp_path / "data" / "aime24.jsonl")
    out = tmp_path / "out"
    code = _main(["run", "aime24", "--model", "tiny-random-melt", "--data-dir", tmp_path / "data", "--output", out,
                  *TINY_RUN])
    _one_line_error(capsys, code, "aime24.jsonl", message)
    assert not out.exists()


@pytest.mark.parametrize("case", ["fifo", "dev-zero", "over-1-GiB"])
def test_a_completions_file_that_is_not_a_regular_file(tmp_path, capsys, case):
    make, message = DATA_FILES[case]
    make(tmp_path / "c.jsonl")
    _one_line_error(capsys, _main(["score", "synthetic", "--completions", tmp_path / "c.jsonl"]), "c.jsonl", message)


@pytest.mark.parametrize("target", ["/dev/full", "/dev/null", "{file}/sub"])
def test_score_details_to_a_device_or_through_a_file(tmp_path, capsys, target):
    (tmp_path / "file").write_text("kept\n")
    (tmp_path / "good.jsonl").write_text(json.dumps({"index": 0, "completions": ["\\boxed{1}"]}) + "\n")
    target = target.format(file=tmp_path / "file")
    code = _main(["score", "synthetic", "--completions", tmp_path / "good.jsonl", "--details", target])
    _one_line_error(capsys, code, "--details")
    assert (tmp_path / "file").read_text() == "kept\n"


def test_report_output_through_a_file(tmp_path, capsys):
    (tmp_path / "afile.txt").write_text("kept\n")
    code = _main(["report", "--results", tmp_path, "--output", tmp_path / "afile.txt" / "sub", "--no-plots"])
    _one_line_error(capsys, code, "afile.txt is a file")
    assert (tmp_path / "afile.txt").read_text() == "kept\n"


@pytest.mark.parametrize("name, make, message", [
    ("config.json", _fifo, "is a FIFO"),
    ("tokenizer.json", _fifo, "is a FIFO"),
    ("model.safetensors", lambda p: p.mkdir(), "is a directory"),
    ("model.safetensors", lambda p: os.symlink(p.name, p), "cannot read"),
])
def test_checkpoint_files_that_are_not_regular_files(tiny_dirs, tmp_path, capsys, name, make, message):
    ckpt = _copy(tiny_dirs, tmp_path)
    (ckpt / name).unlink()
    make(ckpt / name)
    out = tmp_path / "out"
    code = _main(["run", "synthetic", "--model", ckpt, "--output", out, *TINY_RUN])
    _one_line_error(capsys, code, name, message)
    assert not out.exists()


# --- weights and configs that make no sense ----------------------------------------------------------

def _edit_weights(ckpt, edit):
    path = ckpt / "model.safetensors"
    tensors = {k: v.clone() for k, v in load_file(path).items()}
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def _set(name, index, value):
    def edit(tensors):
        key = next(k for k in sorted(tensors) if name in k)
        tensors[key].view(-1)[index] = value
    return edit


@pytest.mark.parametrize("model", ["tiny-random-ouro", "tiny-random-melt", "tiny-random-llama"])
@pytest.mark.parametrize("name, value", [("embed_tokens", math.nan), ("lm_head", math.inf), ("mlp", -math.inf)])
def test_non_finite_weights_are_refused(tiny_dirs, tmp_path, model, name, value):
    ckpt = _copy(tiny_dirs, tmp_path, model)
    keys = load_file(ckpt / "model.safetensors").keys()
    if not any(name in k for k in keys):  # tied embeddings: no lm_head tensor of its own
        name = "embed_tokens"
    _edit_weights(ckpt, _set(name, 7, value))
    _refused(ckpt, "NaN or inf", "every value checked")


def test_very_large_models_get_a_sampled_check_and_say_so(tiny_dirs, tmp_path, monkeypatch):
    from melt_eval.modeling import loading

    ckpt = _copy(tiny_dirs, tmp_path)
    monkeypatch.setattr(loading, "FULL_FINITE_CHECK_PARAMS", 0)  # as for a model over the limit
    monkeypatch.setattr(loading, "SAMPLED_VALUES", 8)
    _edit_weights(ckpt, _set("embed_tokens", 0, math.nan))  # the first row is always among the sampled values
    _refused(ckpt, "NaN or inf", "sampled check: 8 values per tensor")


@pytest.mark.parametrize("model", ["tiny-random-ouro", "tiny-random-llama"])
@pytest.mark.parametrize("field, value", [("rope_theta", math.nan), ("rope_theta", 0), ("rope_theta", -10000.0),
                                          ("rms_norm_eps", -1e-6), ("rms_norm_eps", 0), ("rms_norm_eps", math.inf),
                                          ("rms_norm_eps", "1e-6")])
def test_rope_theta_and_rms_norm_eps_must_be_finite_and_positive(tiny_dirs, tmp_path, model, field, value):
    ckpt = _copy(tiny_dirs, tmp_path, model)
    config = json.loads((ckpt / "config.json").read_text())
    config[field] = value
    if isinstance(config.get("rope_parameters"), dict) and field in config["rope_parameters"]:
        config["rope_parameters"][field] = value
    (ckpt / "config.json").write_text(json.dumps(config))  # NaN and Infinity as Python's json writes them
    _refused(ckpt, field, "must be a finite number > 0")


@pytest.mark.parametrize("model, architecture", [
    ("tiny-random-ouro", "LlamaForCausalLM"),
    ("tiny-random-ouro", "MeltForCausalLM"),
    ("tiny-random-melt", "LoopLMForCausalLM"),
    ("tiny-random-melt", "SomethingElseForCausalLM"),
    ("tiny-random-llama", "Qwen2ForCausalLM"),
    ("tiny-random-llama", "MeltForCausalLM"),
])
def test_architectures_must_agree_with_model_type(tiny_dirs, tmp_path, model, architecture):
    ckpt = _copy(tiny_dirs, tmp_path, model)
    config = json.loads((ckpt / "config.json").read_text())
    config["architectures"] = [architecture]
    (ckpt / "config.json").write_text(json.dumps(config))
    _refused(ckpt, "does not match its architecture", architecture)


def test_tensors_sharing_bytes_are_refused(tiny_dirs, tmp_path):
    ckpt = _copy(tiny_dirs, tmp_path)
    path = ckpt / "model.safetensors"
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    names = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
    a, b = next((x, y) for x, y in zip(names, names[1:])
                if header[x]["dtype"] == header[y]["dtype"] and header[x]["shape"] == header[y]["shape"])
    header[b]["data_offsets"] = list(header[a]["data_offsets"])  # b points at a's bytes
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n :])
    _refused(ckpt, "model.safetensors", f"tensors {a} and {b} share bytes")


@pytest.mark.parametrize("template, kind", [
    ("{% for m in messages %}{{ m.content }{% endfor %}", "TemplateSyntaxError"),
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "SecurityError"),
    ("{{ cycler.__init__.__globals__.os.popen('id').read() }}", "SecurityError"),
])
def test_a_broken_or_injecting_chat_template_is_refused_at_load(tiny_dirs, tmp_path, capsys, template, kind):
    ckpt = _copy(tiny_dirs, tmp_path, "tiny-random-melt")
    for f in ckpt.glob("chat_template.jinja"):
        f.unlink()
    config = json.loads((ckpt / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (ckpt / "tokenizer_config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    code = _main(["run", "synthetic", "--model", ckpt, "--output", out, *TINY_RUN])
    _one_line_error(capsys, code, "chat template", kind)
    assert not out.exists()


# --- report on results of the wrong types --------------------------------------------------------------

def _result(model, task, value=0.5, **extra):
    r = {"model": model, "task": task, "finished": True, "metrics": {"accuracy": {"value": value, "stderr": 0.01}},
         "settings": {"samples": 1, "loops": 4}, "num_problems": 10, "model_path": "/ckpt"}
    r.update(extra)
    return r


WRONG_TYPES = {
    "loops-a-list": ({"settings": {"samples": 1, "loops": [4]}}, "settings.loops is a list"),
    "loops-a-dict": ({"settings": {"samples": 1, "loops": {"a": 4}}}, "settings.loops is a dict"),
    "loops-a-string": ({"settings": {"samples": 1, "loops": "4"}}, "settings.loops is a str"),
    "model-a-list": ({"model": ["m"]}, "model is a list"),
    "settings-a-list": ({"settings": [1]}, "settings is a list"),
    "model-path-a-number": ({"model_path": 5}, "model_path is a int"),
}


@pytest.mark.parametrize("case", WRONG_TYPES)
def test_report_names_a_wrongly_typed_field_and_skips_the_file(tmp_path, capsys, case):
    changes, message = WRONG_TYPES[case]
    root = tmp_path / "results"
    for name, extra in (("good", {}), ("good-T2", {"settings": {"samples": 1, "loops": 2}}), ("bad", changes)):
        (root / name / "math500").mkdir(parents=True)
        (root / name / "math500" / "results.json").write_text(json.dumps(_result(name, "math500", 0.625) | extra))
    code = _main(["report", "--results", root, "--output", tmp_path / "r", "--markdown"])
    captured = capsys.readouterr()
    assert code == 0 and "Traceback" not in captured.err, captured.err
    note = next(line for line in captured.out.splitlines() if str(root / "bad") in line)
    assert message in note, note
    assert "62.5" in (tmp_path / "r" / "report.md").read_text()


# --- memory and disk -------------------------------------------------------------------------------

def test_samples_beyond_memory_are_refused_before_allocating(tmp_path, capsys):
    out = tmp_path / "out"
    code = _main(["run", "synthetic", "--model", "tiny-random-melt", "--output", out, "--max-problems", "1",
                  "--samples", "1000000000", "--max-new-tokens", "2", "--no-progress"])
    _one_line_error(capsys, code, "--samples 1000000000", "lower --samples or --max-new-tokens")
    assert not list(out.rglob("*.json")) if out.exists() else True


def test_an_allocation_the_engine_did_not_foresee_names_the_options_to_lower(tmp_path, capsys, monkeypatch):
    from melt_eval.generation import backends

    def fail(*_, **__):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:118] DefaultCPUAllocator: can't allocate memory: "
                           "you tried to allocate 400000000000 bytes")

    monkeypatch.setattr(backends.NativeBackend, "generate", fail)
    code = _main(["run", "synthetic", "--model", "tiny-random-melt", "--output", tmp_path / "out", *TINY_RUN])
    _one_line_error(capsys, code, "ran out of memory", "lower --samples, --max-new-tokens or --max-cache-bytes")


RUN = dict(options=InferenceOptions(sampling=Sampling(samples=2, max_new_tokens=4)), max_problems=3, progress=False)


def _run(out):
    return run_tasks("synthetic", "tiny-random-ouro", paths=RunPaths(output=out), **RUN)[0]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("straight")
    return _run(out), out / "tiny-random-ouro" / "synthetic"


def _fail_writes_after(monkeypatch, module, whole: int, exc):
    """os.write in `module` writes `whole` lines, then half a line, then raises `exc`."""
    real, calls = os.write, []

    def write(fd, data):
        calls.append(fd)
        if len(calls) <= whole:
            return real(fd, data)
        real(fd, bytes(data)[: len(data) // 2])
        raise exc

    monkeypatch.setattr(module.os, "write", write)


def test_a_full_disk_while_appending_completions_is_one_line_and_keeps_them(tmp_path, capsys, monkeypatch,
                                                                            uninterrupted):
    from melt_eval.evaluation import lighteval_model

    straight, straight_dir = uninterrupted
    out = tmp_path / "out"
    # the first problem's line and its segments.jsonl record, then half of the second problem's line
    _fail_writes_after(monkeypatch, lighteval_model, 2, OSError(errno.ENOSPC, "No space left on device"))
    code = _main(["run", "synthetic", "--model", "tiny-random-ouro", "--output", out, "--max-problems", "3",
                  "--samples", "2", "--max-new-tokens", "4", "--no-progress"])
    _one_line_error(capsys, code, "completions.jsonl", "the disk is full", "1 problems finished before are kept")
    store = out / "tiny-random-ouro" / "synthetic" / "completions.jsonl"
    lines = store.read_text().splitlines(keepends=True)
    assert len(lines) == 1 and lines[0].endswith("\n")  # the half line was cut, the whole one kept
    monkeypatch.undo()
    resumed = _run(out)
    task_dir = out / "tiny-random-ouro" / "synthetic"
    assert (task_dir / "details.jsonl").read_text() == (straight_dir / "details.jsonl").read_text()
    assert resumed["generated_tokens"] == straight["generated_tokens"]


def test_a_full_disk_while_writing_details_is_one_line_and_keeps_completions(tmp_path, capsys, monkeypatch,
                                                                             uninterrupted):
    from melt_eval.evaluation import runner

    straight, straight_dir = uninterrupted

    def full(path, text):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(runner, "write_text_atomic", full)
    out = tmp_path / "out"
    code = _main(["run", "synthetic", "--model", "tiny-random-ouro", "--output", out, "--max-problems", "3",
                  "--samples", "2", "--max-new-tokens", "4", "--no-progress"])
    _one_line_error(capsys, code, "details.jsonl", "the disk is full", "kept in completions.jsonl")
    task_dir = out / "tiny-random-ouro" / "synthetic"
    assert (task_dir / "completions.jsonl").read_text().count("\n") == 3
    assert not (task_dir / "results.json").exists()


# --- resumed runs report what an uninterrupted one does --------------------------------------------

def _interrupt_after(monkeypatch, problems: int):
    """Ctrl-C in the run once `problems` problems are stored (the rest of the batch is lost)."""
    from melt_eval.evaluation.lighteval_model import CompletionStore

    real, calls = CompletionStore.add, []

    def add(self, *args):
        if len(calls) == problems:
            raise KeyboardInterrupt
        calls.append(1)
        real(self, *args)

    monkeypatch.setattr(CompletionStore, "add", add)


def test_an_interrupted_and_resumed_run_reports_the_uninterrupted_numbers(tmp_path, monkeypatch, uninterrupted):
    straight, straight_dir = uninterrupted
    assert straight["segments"] == 1 and straight["peak_cache_bytes"] > 0
    out = tmp_path / "out"
    _interrupt_after(monkeypatch, 1)
    with pytest.raises(KeyboardInterrupt):
        _run(out)
    monkeypatch.undo()
    task_dir = out / "tiny-random-ouro" / "synthetic"
    first = json.loads((task_dir / "segments.jsonl").read_text().splitlines()[0])
    resumed = _run(out)
    for name in ("completions.jsonl", "details.jsonl"):  # the resume checkpoint stays byte-identical
        assert (task_dir / name).read_bytes() == (straight_dir / name).read_bytes()
    assert resumed["metrics"] == straight["metrics"]
    assert resumed["generated_tokens"] == straight["generated_tokens"]
    # the first segment's batch held all three problems: its peak is the uninterrupted run's, which the
    # second segment's smaller batch does not reach; today's code reported the second segment's alone
    assert resumed["peak_cache_bytes"] == straight["peak_cache_bytes"] == first["peak_cache_bytes"]
    assert resumed["segments"] == 2
    assert resumed["wall_time_s"] >= first["wall_s"] > 0


def test_a_resumed_run_with_nothing_left_to_generate_keeps_the_peak(tmp_path, uninterrupted):
    straight, straight_dir = uninterrupted
    out = tmp_path / "out"
    shutil.copytree(straight_dir, out / "tiny-random-ouro" / "synthetic")
    task_dir = out / "tiny-random-ouro" / "synthetic"
    (task_dir / "results.json").unlink()  # killed after the last problem was stored
    stored = max(json.loads(line)["wall_s"] for line in (task_dir / "segments.jsonl").read_text().splitlines())
    resumed = _run(out)
    assert resumed["peak_cache_bytes"] == straight["peak_cache_bytes"] is not None
    assert resumed["generated_tokens"] == straight["generated_tokens"]
    assert resumed["segments"] == 2
    assert resumed["wall_time_s"] > stored > 0  # the first segment's generation time is counted, not reset


# --- issue 52: nothing accepted silently ------------------------------------------------------------

def _harness_written(tiny_dirs, tmp_path):
    """A model directory as `train` exports one: its files, SHA256SUMS over them and the training record."""
    from melt_eval.files import TRAINING_META, write_sums

    ckpt = _copy(tiny_dirs, tmp_path)
    write_sums(ckpt, [p.name for p in ckpt.iterdir() if p.is_file()])
    (ckpt / TRAINING_META).write_text(json.dumps({"status": "finished", "recipe": {"target": "looplm"}}))
    return ckpt


def _zero_tensor_bytes(path, n=64):
    data = bytearray(path.read_bytes())
    start = 8 + int.from_bytes(data[:8], "little") + 16
    data[start:start + n] = bytes(n)
    path.write_bytes(bytes(data))


def _results(out, model, task="synthetic"):
    return json.loads((out / model / task / "results.json").read_text())


@pytest.mark.parametrize("sums", ["deleted", "fifo", "directory"])
def test_a_harness_written_model_without_its_sums_is_refused_unless_no_verify(tiny_dirs, tmp_path, capsys, sums):
    """Issue 52 item 2: SHA256SUMS deleted (and weights damaged), or replaced by a FIFO or a directory: `run`
    names it in one line and refuses; --no-verify loads it, and results.json says the sums were not verified."""
    from melt_eval.files import SUMS_FILE

    ckpt = _harness_written(tiny_dirs, tmp_path)
    _zero_tensor_bytes(ckpt / "model.safetensors")
    (ckpt / SUMS_FILE).unlink()
    if sums == "fifo":
        os.mkfifo(ckpt / SUMS_FILE)
    elif sums == "directory":
        (ckpt / SUMS_FILE).mkdir()
    out = tmp_path / "out"
    code = _main(["run", "synthetic", "--model", ckpt, "--output", out, *TINY_RUN])
    _one_line_error(capsys, code, SUMS_FILE, "--no-verify")
    assert not out.exists()
    assert _main(["run", "synthetic", "--model", ckpt, "--output", out, *TINY_RUN, "--no-verify"]) == 0
    assert _results(out, "ckpt")["sums_verified"] is False


def test_results_record_whether_the_sums_were_verified(tiny_dirs, tmp_path):
    """A harness-written directory with its sums: verified; a directory from elsewhere (no record, no sums: a Hub
    snapshot, another tool's, a registry model built here) keeps loading, recorded as not verified."""
    ckpt = _harness_written(tiny_dirs, tmp_path)
    assert _main(["run", "synthetic", "--model", ckpt, "--output", tmp_path / "out", *TINY_RUN]) == 0
    assert _results(tmp_path / "out", "ckpt")["sums_verified"] is True
    elsewhere = _copy(tiny_dirs, tmp_path / "plain")
    assert _main(["run", "synthetic", "--model", elsewhere, "--output", tmp_path / "out2", *TINY_RUN]) == 0
    assert _results(tmp_path / "out2", "ckpt")["sums_verified"] is False


def _jsonl(path, *rows):
    path.write_text("".join(r if isinstance(r, str) else json.dumps(r) + "\n" for r in rows))
    return path


BARE = {"task_id": "t/0", "prompt": "def f(x):\n", "entry_point": "f",
        "test": "def check(candidate):\n    assert candidate(2) == 3\n"}


@pytest.mark.parametrize("case", ["nan-answer", "list-problem", "index-true", "port-70000", "base-nosuch",
                                  "uncompilable-check"])
def test_round_three_inputs_accepted_silently_are_one_line_and_exit_2(tmp_path, capsys, case):
    """Issue 52 item 6 (and item 5's data error): each is one line on stderr and exit 2, nothing scored."""
    data = tmp_path / "data"
    data.mkdir()
    good = {"problem": "What is 1 + 1?", "answer": "2"}
    if case == "nan-answer":
        _jsonl(data / "aime24.jsonl", '{"problem": "What is 0/0?", "answer": NaN}\n', good)
        args, words = ["run", "aime24", "--model", "tiny-random-ouro", "--data-dir", data], ["row 0", "nan"]
    elif case == "list-problem":
        _jsonl(data / "aime24.jsonl", {"problem": ["What is", "1 + 1?"], "answer": "2"})
        args, words = ["run", "aime24", "--model", "tiny-random-ouro", "--data-dir", data], ["row 0", "list, not text"]
    elif case == "index-true":
        _jsonl(data / "aime24.jsonl", good, good)
        done = _jsonl(tmp_path / "done.jsonl", {"index": True, "completions": ["\\boxed{2}"]})
        args, words = ["score", "aime24", "--data-dir", data, "--completions", done], ["index True names no problem"]
    elif case == "port-70000":
        args, words = ["serve", "tiny-random-ouro", "--port", "70000", "--dry-run"], ["--port", "65535", "70000"]
    elif case == "base-nosuch":
        args, words = ["ablate", "gates", "--preset", "tiny", "--base", "nosuch", "--dry-run"], ["--base 'nosuch'"]
    else:  # a test that does not compile: no completion could pass, so it is the data's error, not the model's
        _jsonl(data / "humaneval.jsonl", dict(BARE, test="def check(candidate)\n    assert candidate(2) == 3\n"))
        done = _jsonl(tmp_path / "done.jsonl", {"index": 0, "completions": ["    return x + 1\n"]})
        args = ["score", "humaneval", "--data-dir", data, "--completions", done]
        words = ["t/0", "do not compile as the checker's code", "fix the data"]
    out = tmp_path / "out"
    if args[0] == "run":
        args += ["--output", out, *TINY_RUN]
    _one_line_error(capsys, _main(args), *words)
    assert not out.exists()


def test_the_checker_takes_a_bare_signatures_helpers(tmp_path, capsys):
    """Issue 52 item 5: with prompt `def f(x):` (valid HumanEval-format data, no docstring) a correct body passes
    and a wrong one fails; helpers defined before the signature still reach the tests."""
    data = tmp_path / "data"
    data.mkdir()
    helper = dict(BARE, task_id="t/1", prompt="def twice(y):\n    return 2 * y\n\ndef f(x):\n",
                  test="def check(candidate):\n    assert candidate(2) == twice(2) - 1\n")
    _jsonl(data / "humaneval.jsonl", BARE, helper)
    done = _jsonl(tmp_path / "done.jsonl", {"index": 0, "completions": ["    return x + 1\n", "    return x + 2\n"]},
                  {"index": 1, "completions": ["```python\ndef f(x):\n    return x + 1\n```", "    return x\n"]})
    assert _main(["score", "humaneval", "--data-dir", data, "--completions", done, "--details", tmp_path / "d.jsonl"]) == 0
    details = [json.loads(line) for line in (tmp_path / "d.jsonl").read_text().splitlines()]
    assert [[c["correct"] for c in d["completions"]] for d in details] == [[True, False], [True, False]]


def _stored_run(tmp_path, uninterrupted):
    """The uninterrupted run's directory, as if killed after its last problem was stored."""
    straight, straight_dir = uninterrupted
    out = tmp_path / "out"
    shutil.copytree(straight_dir, out / "tiny-random-ouro" / "synthetic")
    task_dir = out / "tiny-random-ouro" / "synthetic"
    (task_dir / "results.json").unlink()
    return out, task_dir


@pytest.mark.parametrize("line", ["conflicting", "foreign", "short-after-finished"])
def test_a_completions_line_that_conflicts_or_belongs_to_no_problem_is_refused(tmp_path, capsys, uninterrupted, line):
    """Issue 52 item 7: a line with an existing problem's key and other completions (it replaced the original),
    one whose key is no problem of the run (its tokens were added), or a shorter line after the finished one
    (which made the problem be generated again): named in one line, and the run refuses rather than choosing.
    (A short line before its finished one is the run's own history: test_bad_input's store tests.)"""
    out, task_dir = _stored_run(tmp_path, uninterrupted)
    store = task_dir / "completions.jsonl"
    first = json.loads(store.read_text().splitlines()[0])
    added = {"conflicting": dict(first, completions=["other", "text"], tokens=983),
             "foreign": dict(first, key="0123456789abcdef", tokens=8),
             "short-after-finished": dict(first, completions=first["completions"][:1])}[line]
    with open(store, "a") as f:
        f.write(json.dumps(added) + "\n")
    before = store.read_bytes()
    code = _main(["run", "synthetic", "--model", "tiny-random-ouro", "--output", out, "--max-problems", "3",
                  "--samples", "2", "--max-new-tokens", "4", "--no-progress"])
    _one_line_error(capsys, code, "completions.jsonl:4", "delete", "re-run")
    assert store.read_bytes() == before and not (task_dir / "results.json").exists()


def test_an_identical_repeated_completions_line_is_not_a_conflict(tmp_path, uninterrupted):
    out, task_dir = _stored_run(tmp_path, uninterrupted)
    store = task_dir / "completions.jsonl"
    with open(store, "a") as f:
        f.write(store.read_text().splitlines()[0] + "\n")
    assert _run(out)["generated_tokens"] == uninterrupted[0]["generated_tokens"]


def test_a_full_disk_while_lighteval_writes_its_parquet_is_one_line_and_leaves_no_partial_file(
        tmp_path, capsys, monkeypatch, uninterrupted):
    """Issue 52 item 7: ENOSPC inside LightEval's details parquet: one line, no 0-byte parquet or results file of
    LightEval's left, completions kept; the next run finishes as the uninterrupted one."""
    import datasets

    def full(self, f, *args, **kwargs):
        f.write(b"PAR1")  # a start, as a real write gets before the disk fills
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(datasets.Dataset, "to_parquet", full)
    out, task_dir = _stored_run(tmp_path, uninterrupted)
    shutil.rmtree(task_dir / "details")
    for old in task_dir.glob("results_*.json"):
        old.unlink()
    code = _main(["run", "synthetic", "--model", "tiny-random-ouro", "--output", out, "--max-problems", "3",
                  "--samples", "2", "--max-new-tokens", "4", "--no-progress"])
    _one_line_error(capsys, code, "the disk is full", "partial files were removed", "completions.jsonl")
    assert not list(task_dir.glob("results_*.json")) and not (task_dir / "details").exists()
    assert not (task_dir / "results.json").exists()
    monkeypatch.undo()
    assert _run(out)["metrics"] == uninterrupted[0]["metrics"]
    assert [p.stat().st_size > 0 for p in (task_dir / "details").rglob("*.parquet")] == [True]


def test_a_resumed_runs_progress_counts_from_the_problems_already_done(tmp_path, capsys, uninterrupted):
    out, task_dir = _stored_run(tmp_path, uninterrupted)
    lines = (task_dir / "completions.jsonl").read_text().splitlines()
    (task_dir / "completions.jsonl").write_text("\n".join(lines[:2]) + "\n")
    os.environ["MELT_EVAL_PLAIN_PROGRESS"] = "1"
    try:
        assert _main(["run", "synthetic", "--model", "tiny-random-ouro", "--output", out, "--max-problems", "3",
                      "--samples", "2", "--max-new-tokens", "4"]) == 0
    finally:
        del os.environ["MELT_EVAL_PLAIN_PROGRESS"]
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[tiny-random-ouro / synthetic] ")]
    assert printed[0].split("problems ")[1].startswith("2/3"), printed  # not 0/3
    assert printed[-1].split("problems ")[1].startswith("3/3"), printed


# kill -9 of `run` at several points, then the same command: results.json equals the uninterrupted run's in
# every field but the timings (wall_time_s, date, the dated names of LightEval's files) and `segments`, which
# counts the interruptions by design
KILL_POINTS = {
    "before-the-first-problem": "store-add-0",
    "after-one-problem": "store-add-1",
    "after-every-problem": "finish",
    "after-details-before-results": "results",
}
KILLER = r"""
import os, signal, sys
from melt_eval.evaluation import lighteval_model, runner
point = os.environ["KILL_AT"]
def die():
    os.kill(os.getpid(), signal.SIGKILL)
if point.startswith("store-add-"):
    real, n = lighteval_model.CompletionStore.add, int(point.rsplit("-", 1)[1])
    calls = []
    def add(self, *a, **k):
        if len(calls) == n:
            die()
        calls.append(1)
        return real(self, *a, **k)
    lighteval_model.CompletionStore.add = add
elif point == "finish":
    real_finish = runner._finish
    runner._finish = lambda *a, **k: die()
elif point == "results":
    real_write = runner.write_json_atomic
    runner.write_json_atomic = lambda path, obj: die() if path.name == "results.json" else real_write(path, obj)
from melt_eval.cli import main
sys.argv = ["melt-eval", *sys.argv[1:]]
main()
"""
TIMINGS = ("wall_time_s", "date", "lighteval_files", "segments")


@pytest.mark.parametrize("point", KILL_POINTS)
def test_kill_9_at_several_points_then_the_same_command_gives_the_uninterrupted_results(tmp_path, uninterrupted,
                                                                                      point):
    import subprocess
    import sys

    straight, _ = uninterrupted
    out = tmp_path / "out"
    args = ["run", "synthetic", "--model", "tiny-random-ouro", "--output", str(out), "--max-problems", "3",
            "--samples", "2", "--max-new-tokens", "4", "--no-progress"]
    env = {**os.environ, "KILL_AT": KILL_POINTS[point]}
    killed = subprocess.run([sys.executable, "-c", KILLER, *args], env=env, capture_output=True, text=True, timeout=600)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    task_dir = out / "tiny-random-ouro" / "synthetic"
    assert not (task_dir / "results.json").exists()
    assert _main(args) == 0
    resumed = json.loads((task_dir / "results.json").read_text())
    assert {k: v for k, v in resumed.items() if k not in TIMINGS} == {k: v for k, v in straight.items()
                                                                       if k not in TIMINGS}
    assert resumed["analytic_cache_bytes"] and resumed["cache_rows"]  # today's numbers, not null


def test_a_full_disk_when_run_json_is_written_is_one_line(tmp_path, capsys, monkeypatch):
    """Issue 52 item 7: anywhere in a task's run, not only the files that had their own handler."""
    from melt_eval.evaluation import runner

    real = runner.write_json_atomic

    def full(path, obj):
        if path.name == "run.json":
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(path, obj)

    monkeypatch.setattr(runner, "write_json_atomic", full)
    code = _main(["run", "synthetic", "--model", "tiny-random-ouro", "--output", tmp_path / "out", *TINY_RUN])
    _one_line_error(capsys, code, "run.json", "the disk is full")
    assert not list((tmp_path / "out").rglob("run.json"))


def test_train_config_on_a_fifo_is_named_not_missing(tmp_path, capsys):
    """Issue 52 item 7: `train --config` on a FIFO said the path "does not exist"."""
    fifo = _fifo(tmp_path / "keys.yaml")
    code = _main(["train", "--recipe", "tiny-phase1", "--from", "tiny-random-ouro", "--output", tmp_path / "t",
                  "--config", fifo])
    _one_line_error(capsys, code, "--config", "keys.yaml is a FIFO", "a YAML file of recipe keys")
    assert not (tmp_path / "t").exists()
