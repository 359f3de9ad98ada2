"""Issue 41, training side: hostile recipe values and data files are one line (exit 2) before anything is
allocated; Ctrl-C at any moment of `train` is exit 130 with one line and leaves a run the next command
continues; damaged checkpoints are caught by their SHA-256 (resume falls back, `run` refuses)."""

from __future__ import annotations

import errno
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import typer
import torch
from safetensors.torch import load_file

from melt_eval.errors import UserError
from melt_eval.files import SUMS_FILE
from melt_eval.training import run_recipe

from helpers import main_exit_code as _main
from helpers import one_line_error as _one_line_error

REPO = Path(__file__).resolve().parents[1]
TRAIN = ["train", "--recipe", "tiny-phase1", "--from", "tiny-random-ouro", "--no-progress"]
FAST = {"seq_len": 64, "micro_batch_size": 4, "batch_tokens": 512, "warmup_steps": 1, "interpolation_steps": 3,
        "chunk_size": 16, "save_every": 1, "keep_checkpoints": 3, "max_steps": 4,
        "data": [{"source": "synthetic", "n": 100, "num_steps": 1}], "tensorboard": False}

pytestmark = pytest.mark.usefixtures("one_thread")


# --- recipe values: by type, finiteness and what memory can hold ---------------------------------------

def synthetic(**extra) -> str:
    return "data=" + json.dumps([{"source": "synthetic", "n": 100, "num_steps": 1, **extra}])


HOSTILE_SETS = [  # --set value -> what the one line names
    ("micro_batch_size=100000000", "micro_batch_size needs at least"),
    ("seq_len=1000000000000", "micro_batch_size needs at least"),
    ("batch_tokens=100000000000000", "batch_tokens needs at least"),
    ("shuffle_buffer=1000000000000", "shuffle_buffer needs at least"),
    (synthetic(n=10**12), "data n needs at least"),
    (synthetic(n=[1, 2]), "n must be a whole number"),
    (synthetic(num_steps={"a": 1}), "num_steps must be a whole number or [lo, hi]"),
    (synthetic(num_steps=[1, "x"]), "num_steps must be a whole number or [lo, hi]"),
    (synthetic(weight="abc"), "weight must be a finite number >= 0, got 'abc'"),
    ("data=[{source: synthetic, weight: .nan}]", "weight must be a finite number >= 0, got nan"),
    ("data=[{source: synthetic, weight: .inf}]", "weight must be a finite number >= 0, got inf"),
    (synthetic(weight=True), "weight must be a finite number"),
    (synthetic(weight=-1), "weight must be a finite number >= 0"),
    (synthetic(weight=0), "weights must have a positive sum"),
    (synthetic(n=0), "n must be >= 1"),
    (synthetic(form=3), "form must be a string"),
    ("data=[5]", "needs `source` set to one of"),
    ("data=[{source: local, path: [a]}]", "path must be a string"),
    ("data=[{source: synthetic, bogus: 1}]", "unknown key(s) bogus"),
]


@pytest.mark.parametrize("value, message", HOSTILE_SETS, ids=[v for v, _ in HOSTILE_SETS])
def test_hostile_recipe_values_are_one_line_before_anything_is_built(tmp_path, capsys, value, message):
    out = tmp_path / "train"
    start = time.monotonic()
    code = _main([*TRAIN, "--output", out, "--set", value])
    _one_line_error(capsys, code, message)
    assert not out.exists()
    assert time.monotonic() - start < 60  # refused, not drawn: the hang of issue 41 took minutes


def test_micro_batch_bound_names_the_option_and_the_memory(tmp_path, capsys):
    code = _main([*TRAIN, "--output", tmp_path / "t", "--set", "micro_batch_size=100000000"])
    err = _one_line_error(capsys, code, "micro_batch_size", "of memory", "lower micro_batch_size")
    assert "GiB" in err or "TiB" in err


# --- local training files: regular UTF-8 files only -----------------------------------------------------

def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _latin1(path: Path) -> None:
    path.write_bytes(b'{"messages": [{"role": "user", "content": "caf\xe9"}]}\n')


def _directory(path: Path) -> None:
    path.mkdir()


def _device(path: Path) -> None:
    path.symlink_to("/dev/zero")


BAD_FILES = {"fifo": (_fifo, "is a FIFO"), "non-utf8": (_latin1, "not UTF-8"),
             "directory": (_directory, "is a directory"), "device": (_device, "not a regular file")}


@pytest.mark.parametrize("case", BAD_FILES)
def test_local_data_must_be_a_regular_utf8_file(tmp_path, capsys, case):
    make, message = BAD_FILES[case]
    make(tmp_path / "train.jsonl")
    out = tmp_path / "run"
    data = json.dumps([{"source": "local", "path": str(tmp_path / "train.jsonl")}])
    code = _main([*TRAIN, "--output", out, "--set", f"data={data}", "--set", "max_steps=1",
                  "--set", "seq_len=64", "--set", "batch_tokens=128", "--set", "tensorboard=false"])
    _one_line_error(capsys, code, "train.jsonl", message)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", BAD_FILES)
def test_a_recipe_file_must_be_a_regular_utf8_file(tmp_path, capsys, case):
    """A FIFO, a directory or a device given as --recipe was called an unknown recipe; each is named now,
    before it is opened (a FIFO would block the read)."""
    make, message = BAD_FILES[case]
    make(tmp_path / "recipe.yaml")
    code = _main(["train", "--recipe", tmp_path / "recipe.yaml", "--output", tmp_path / "run", "--no-progress"])
    _one_line_error(capsys, code, "recipe.yaml", "is a device" if case == "device" else message)
    assert not (tmp_path / "run").exists()


# --- checkpoints checked by content -----------------------------------------------------------------------

def flip_tensor_bytes(path: Path) -> None:
    """Flip bytes inside a safetensors file's tensor data (after its header), keeping its size."""
    data = bytearray(path.read_bytes())
    start = 8 + int.from_bytes(data[:8], "little")
    for i in range(start + 16, min(start + 64, len(data))):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_damaged_newest_checkpoint_is_skipped_by_its_hash_and_the_run_matches(tmp_path, capfd):
    straight = run_recipe("tiny-phase1", "tiny-random-ouro", tmp_path / "straight", overrides=FAST, progress=False)
    out = tmp_path / "run"
    run_recipe("tiny-phase1", "tiny-random-ouro", out, overrides=FAST, progress=False, stop_after=3)
    newest = out / "checkpoints" / "step-000003"
    state = json.loads((newest / "trainer_state.json").read_text())
    assert set(state["sha256"]) == set(state["files"])
    weights = newest / "state" / "model.safetensors"
    size = weights.stat().st_size
    flip_tensor_bytes(weights)
    assert weights.stat().st_size == size
    capfd.readouterr()
    run_recipe("tiny-phase1", "tiny-random-ouro", out, overrides=FAST, progress=False, resume=True)
    captured = capfd.readouterr()
    warning = [line for line in captured.err.splitlines() if "step-000003" in line]
    assert len(warning) == 1 and "state/model.safetensors does not match its SHA-256" in warning[0], captured.err
    assert "resuming from step-000002" in warning[0]
    assert "at step 2 from step-000002" in captured.out
    got, want = load_file(out / "model.safetensors"), load_file(straight / "model.safetensors")
    assert all(torch.equal(got[k], want[k]) for k in want)  # redone from step 2: the uninterrupted weights


def test_run_refuses_a_damaged_checkpoint_in_one_line_and_no_verify_skips_the_check(tmp_path, capsys):
    model = run_recipe("tiny-phase1", "tiny-random-ouro", tmp_path / "model", overrides={**FAST, "max_steps": 1},
                       progress=False)
    sums = (model / SUMS_FILE).read_text()
    assert "  model.safetensors\n" in sums and "  config.json\n" in sums
    run = ["run", "synthetic", "--model", str(model), "--max-problems", "1", "--max-new-tokens", "2", "--no-progress"]
    assert _main([*run, "--output", tmp_path / "ok"]) == 0
    capsys.readouterr()
    flip_tensor_bytes(model / "model.safetensors")
    code = _main([*run, "--output", tmp_path / "bad"])
    _one_line_error(capsys, code, "model.safetensors does not match its SHA-256", "damaged", "--no-verify")
    assert _main([*run, "--output", tmp_path / "unchecked", "--no-verify"]) == 0


# --- Ctrl-C at any moment ---------------------------------------------------------------------------------

def train_process(out: Path, *extra: str) -> subprocess.Popen:
    config = out.parent / "fast.yaml"
    config.write_text(json.dumps({**FAST, "max_steps": 40}))
    env = {**os.environ, "PYTHONPATH": str(REPO)}  # the pinned thread count: another would add a note line
    return subprocess.Popen([sys.executable, "-m", "melt_eval.cli", *TRAIN, "--output", str(out), "--config",
                             str(config), *extra], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def catches_sigint(pid: int) -> bool:
    """Whether the process has a SIGINT handler yet (Linux: SigCgt in /proc/PID/status). Before the interpreter
    installs one, Ctrl-C kills any Python program silently (-SIGINT), whatever its code."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    caught = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
    return bool(caught & (1 << (signal.SIGINT - 1)))


def wait_for(condition, proc: subprocess.Popen, timeout: float = 300) -> None:
    end = time.monotonic() + timeout
    while not condition() and proc.poll() is None and time.monotonic() < end:
        time.sleep(0.005)


def checkpoints(out: Path) -> list[str]:
    root = out / "checkpoints"
    return sorted(p.name for p in root.iterdir()) if root.is_dir() else []


@pytest.mark.slow
@pytest.mark.parametrize("moment", ["start-up", "steps", "save"])
def test_ctrl_c_at_a_random_moment_is_one_line_and_the_next_run_continues(tmp_path, moment):
    seed = int(time.time() * 1000) % 100_000
    rng = random.Random(seed)
    out = tmp_path / "run"
    proc = train_process(out)
    if moment == "start-up":  # imports, model building, data: before the first step is logged
        # the interpreter's own start (until it catches SIGINT, then site and io) is Python's to report
        wait_for(lambda: catches_sigint(proc.pid), proc)
        time.sleep(rng.uniform(0.15, 3.0))
    elif moment == "steps":
        wait_for(lambda: len(checkpoints(out)) >= 1, proc)
        time.sleep(rng.uniform(0, 0.5))
    else:  # while a checkpoint's temporary directory is being written
        wait_for(lambda: any(n.startswith(".tmp-") for n in checkpoints(out)), proc)
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    lines = err.strip().splitlines()
    assert proc.returncode == 130, f"seed {seed}: {err}"
    assert len(lines) == 1 and lines[0].startswith("interrupted: "), f"seed {seed}: {err}"
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    resume = ["--resume"] if "--resume" in lines[0] and "without --resume" not in lines[0] else []
    again = train_process(out, *resume)
    _, err = again.communicate(timeout=600)
    assert again.returncode == 0, f"seed {seed}, after {lines[0]!r}: {err}"
    assert json.loads((out / "melt_eval_training.json").read_text())["status"] == "finished"


def test_an_error_after_ctrl_c_is_the_interrupt_and_any_other_error_is_not(tmp_path, monkeypatch, capsys):
    """An import cut by Ctrl-C can fail later with another error (numpy.dtypes half-bound: RecursionError)."""
    from melt_eval import interrupts
    from melt_eval.training.cli import one_line_interrupt

    monkeypatch.setattr(interrupts, "_requested", False)
    monkeypatch.setattr(interrupts, "_reported", False)
    with pytest.raises(RecursionError):  # no Ctrl-C: the error is the error
        with one_line_interrupt(tmp_path / "run"):
            raise RecursionError("maximum recursion depth exceeded")
    monkeypatch.setattr(interrupts, "_requested", True)
    with pytest.raises(typer.Exit) as exit_info:
        with one_line_interrupt(tmp_path / "run"):
            raise RecursionError("maximum recursion depth exceeded")
    assert exit_info.value.exit_code == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["interrupted: nothing was written yet; run the same command again (without --resume)"]


def test_a_ctrl_c_a_library_swallowed_stops_training_at_the_next_step(tmp_path, monkeypatch, capsys):
    from melt_eval import interrupts
    from melt_eval.training import runner

    monkeypatch.setattr(interrupts, "_requested", False)
    monkeypatch.setattr(interrupts, "_reported", False)
    real_step = runner.train_step

    def step_that_loses_a_ctrl_c(t, step, *args):
        record = real_step(t, step, *args)
        if step == 1:
            try:  # what C code that clears every error does with the KeyboardInterrupt
                interrupts._remember_and_raise(signal.SIGINT, None)
            except KeyboardInterrupt:
                pass
        return record

    monkeypatch.setattr(runner, "train_step", step_that_loses_a_ctrl_c)
    config = tmp_path / "fast.yaml"
    config.write_text(json.dumps(FAST))
    out = tmp_path / "run"
    code = _main([*TRAIN, "--output", out, "--config", config])
    assert code == 130
    assert capsys.readouterr().err.strip() == "interrupted: rerun the same command with --resume to continue from step-000002"
    monkeypatch.setattr(interrupts, "_requested", False)
    monkeypatch.setattr(runner, "train_step", real_step)
    assert _main([*TRAIN, "--output", out, "--config", config, "--resume"]) == 0
    assert json.loads((out / "melt_eval_training.json").read_text())["status"] == "finished"


def test_resume_with_nothing_to_resume_says_to_start_without_it(tmp_path, capsys):
    for out in (tmp_path / "missing", tmp_path / "empty"):
        if out.name == "empty":
            out.mkdir()
        code = _main([*TRAIN, "--output", out, "--resume"])
        _one_line_error(capsys, code, "--resume", "without --resume")


# --- a checkpoint save on a full disk (issue 52 item 7) ---------------------------------------------------

class _OneProcess:
    """What write_checkpoint asks of Accelerate, on one process; save_state writes a 4 MiB tensor with torch."""

    is_main_process = True

    def wait_for_everyone(self):
        pass

    def save_state(self, directory):
        os.makedirs(directory, exist_ok=True)
        torch.save(torch.zeros(1 << 20), os.path.join(directory, "model.bin"))


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs (root only: elsewhere the test skips; the ENOSPC test below runs anywhere)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (not root)")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def test_a_checkpoint_save_on_a_full_disk_says_no_space_left(small_disk):
    """torch's writer reports only `unexpected pos ...` / `file write failed`: the line says the disk is full,
    and no partial checkpoint stays behind."""
    from melt_eval.training.checkpoints import write_checkpoint

    with pytest.raises(UserError, match="could not write checkpoint step-000003: no space left on device"):
        write_checkpoint(_OneProcess(), small_disk / "run", {"step": 3}, 2, None)
    assert os.listdir(small_disk / "run" / "checkpoints") == []


def test_a_checkpoint_save_failing_with_enospc_says_no_space_left(tmp_path, monkeypatch):
    from melt_eval.training.checkpoints import write_checkpoint

    def full(self, directory):
        os.makedirs(directory, exist_ok=True)
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:  # torch wraps the write's failure in its own RuntimeError
            raise RuntimeError("[enforce fail at inline_container.cc:603] . unexpected pos 64 vs 0")

    monkeypatch.setattr(_OneProcess, "save_state", full)
    with pytest.raises(UserError, match="no space left on device.*rerun with --resume"):
        write_checkpoint(_OneProcess(), tmp_path / "run", {"step": 3}, 2, None)
    assert os.listdir(tmp_path / "run" / "checkpoints") == []


# --- issue 69 item 2: --no-verify works for --from, and a flag that would do nothing is refused -------------

ONE_SMALL_STEP = ["--max-steps", "1", "--set", "seq_len=64", "--set", "micro_batch_size=2", "--set", "batch_tokens=128",
                  "--set", "save_every=0", "--set", "tensorboard=false"]


def test_train_from_a_harness_model_without_its_sums_needs_no_verify_which_then_loads_it(tmp_path, capsys):
    import shutil

    from melt_eval.files import TRAINING_META
    from melt_eval.modeling.loading import resolve_model_dir

    model = tmp_path / "looplm"
    shutil.copytree(resolve_model_dir("tiny-random-ouro"), model)
    (model / TRAINING_META).write_text(json.dumps({"status": "finished"}))  # written by the harness, no SHA256SUMS
    train = ["train", "--recipe", "tiny-phase1", "--from", model, "--no-progress", *ONE_SMALL_STEP]
    code = _main([*train, "--output", tmp_path / "checked"])
    _one_line_error(capsys, code, SUMS_FILE, "--no-verify")
    assert not (tmp_path / "checked" / "recipe.yaml").exists()
    assert _main([*train, "--output", tmp_path / "unchecked", "--no-verify"]) == 0
    meta = json.loads((tmp_path / "unchecked" / TRAINING_META).read_text())
    assert meta["status"] == "finished" and meta["from_path"] == str(model)
    assert meta["checksums_checked"] is False  # the record says the weights it started from were not checked


@pytest.mark.parametrize("flags, message", [
    (["--no-verify"], "this run loads none"),  # a registry model and no --resume: nothing to check
    (["--hub-model-id", "me/x"], "add --push-to-hub, or drop --hub-model-id"),
    (["--recipe", "pretrain-tiny", "--phase", "1"], "target looplm: drop --phase"),
    (["--recipe", "tiny-exit-gate", "--from", "tiny-random-melt", "--gate", "elementwise"], "converts nothing"),
    (["--recipe", "tiny-phase2", "--from", "tiny-random-melt", "--gate", "scalar"], "already a MELT checkpoint"),
], ids=["no-verify", "hub-model-id", "phase", "gate-exit-gate", "gate-melt"])
def test_a_train_flag_that_would_do_nothing_is_one_line(tmp_path, capsys, flags, message):
    out = tmp_path / "train"
    code = _main([*TRAIN, "--output", out, *flags])  # later --recipe/--from win over TRAIN's
    _one_line_error(capsys, code, message)
    assert not out.exists()


# --- issue 69 item 3: a recipe key the target or combination would ignore is refused, never recorded ----------

IGNORED_KEYS = [  # (flags, what the one line names)
    (["--recipe", "tiny-exit-gate", "--from", "tiny-random-melt", "--set", "compile=captured"],
     "target exit_gate runs the model frozen, which is never compiled"),  # recorded captured, ran eager
    (["--recipe", "tiny-exit-gate", "--from", "tiny-random-melt", "--set", "compile=true"], "never compiled"),
    (["--recipe", "tiny-exit-gate", "--from", "tiny-random-melt", "--set", "gradient_checkpointing=true"],
     "nothing to recompute"),
    (["--recipe", "tiny-exit-aware", "--from", "tiny-random-melt", "--set", "compile=true"],
     "compile: true at chunk_size 1"),  # the per-token step does not run with exited entries
    (["--set", "compile=true", "--set", "gradient_checkpointing=true"], "set compile: captured"),
    # a captured step recomputes itself in its backward: gradient_checkpointing was recorded true and never read
    (["--set", "compile=captured", "--set", "gradient_checkpointing=true"], "set gradient_checkpointing: false"),
    (["--recipe", "pretrain-tiny", "--set", "compile=captured", "--set", "gradient_checkpointing=true"],
     "its own activation checkpoint"),
    (["--recipe", "pretrain-tiny", "--set", "phase=2"], "target looplm has none: set phase: 1"),
    (["--recipe", "pretrain-tiny", "--set", "gate=scalar"], "gate set the gate a LoopLM is converted"),
    (["--recipe", "pretrain-tiny", "--set", "gate_seed=3"], "target looplm converts nothing"),
    (["--recipe", "tiny-exit-gate", "--from", "tiny-random-melt", "--set", "gate_lr=0.01"], "the exit gate trains at lr"),
    (["--set", "model_overrides={hidden_size: 8}"], "need target looplm and from_scratch: true"),
    (["--set", "exit_gate_k=10"], "fits no exit gate"),
    (["--no-kd", "--set", "ce_weight=0.5"], "set ce_weight: 0"),
    (["--recipe", "pretrain-tiny", "--teacher", "tiny-random-ouro"], "target looplm trains without a teacher"),
    (["--recipe", "pretrain-tiny", "--set", "prompt_as_one_chunk=true"], "set prompt_as_one_chunk: false"),
]


@pytest.mark.parametrize("flags, message", IGNORED_KEYS, ids=[" ".join(f[-2:]) for f, _ in IGNORED_KEYS])
def test_a_recipe_key_the_run_would_ignore_is_one_line_before_anything_is_written(tmp_path, capsys, flags, message):
    out = tmp_path / "train"
    code = _main([*TRAIN, "--output", out, *flags])
    _one_line_error(capsys, code, "invalid recipe", message)
    assert not out.exists()
