"""`train --resume` after the interruptions a real run meets: kill -9 at random points of a
checkpoint save, half-written and corrupt checkpoints, a full disk, a cut metrics line, a cut or
corrupt recipe.yaml or melt_eval_training.json. Each resumes from the newest complete checkpoint to
the weights of an uninterrupted run, or stops with one line saying what to do."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from melt_eval.errors import UserError
from melt_eval.training import run_recipe
from melt_eval.training.runner import META_FILE

from helpers import checkpoint_layout

REPO = Path(__file__).resolve().parents[1]
# tiny-phase1 shrunk to a second or so of steps: 2 micro-batches of 4 sequences, a checkpoint every step
FAST = {"seq_len": 64, "micro_batch_size": 4, "batch_tokens": 512, "warmup_steps": 1, "interpolation_steps": 3,
        "chunk_size": 16, "save_every": 1, "keep_checkpoints": 4, "max_steps": 12,
        "data": [{"source": "synthetic", "n": 100, "num_steps": 1}], "tensorboard": False}


pytestmark = pytest.mark.usefixtures("one_thread")


def train(out: Path, **kwargs) -> Path:
    return run_recipe("tiny-phase1", "tiny-random-ouro", out, overrides=FAST, progress=False, **kwargs)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted run every resumed one must reproduce."""
    out = train(tmp_path_factory.mktemp("straight") / "run")
    return load_file(out / "model.safetensors"), [json.loads(line)["loss"] for line in metrics(out)]


def metrics(out: Path) -> list[str]:
    return (out / "logs" / "metrics.jsonl").read_text().splitlines()


def assert_same_as_straight(out: Path, straight) -> None:
    weights, losses = straight
    assert json.loads((out / META_FILE).read_text())["status"] == "finished"
    got = load_file(out / "model.safetensors")
    assert got.keys() == weights.keys() and all(torch.allclose(got[k], weights[k], atol=1e-6) for k in got)
    records = [json.loads(line) for line in metrics(out)]
    assert [r["step"] for r in records] == list(range(1, FAST["max_steps"] + 1))
    assert [r["loss"] for r in records] == pytest.approx(losses, rel=1e-5)
    ckpts = out / "checkpoints"
    assert all(p.name.startswith("step-") for p in ckpts.iterdir())  # no temporary or half-deleted directory left
    for ckpt in ckpts.iterdir():
        listed = json.loads((ckpt / "trainer_state.json").read_text())["files"]
        assert {rel: (ckpt / rel).stat().st_size for rel in listed} == listed


def test_resume_takes_the_newest_complete_checkpoint_and_names_what_it_skipped(tmp_path, straight, capsys):
    out = tmp_path / "run"
    train(out, stop_after=4)
    ckpts = out / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-000001", "step-000002", "step-000003", "step-000004"]
    size = (ckpts / "step-000004" / "state" / "model.safetensors").stat().st_size
    # step 4: a state file cut short
    cut = ckpts / "step-000004" / "state" / "model.safetensors"
    cut.write_bytes(cut.read_bytes()[: size // 2])
    # step 3: garbage of the right size (only loading it tells)
    (ckpts / "step-000003" / "state" / "model.safetensors").write_bytes(os.urandom(size))
    # ... in a checkpoint written before checkpoints recorded hashes (test_train_hardening: with them)
    state3 = ckpts / "step-000003" / "trainer_state.json"
    state3.write_text(json.dumps({k: v for k, v in json.loads(state3.read_text()).items() if k != "sha256"}))
    # step 5: half written by a save that was not atomic, and a temporary one from an interrupted atomic save
    (ckpts / "step-000005" / "state").mkdir(parents=True)
    (ckpts / "step-000005" / "state" / "optimizer.bin").write_bytes(b"\x00" * 1000)
    (ckpts / ".tmp-step-000005" / "state").mkdir(parents=True)
    # the last metrics line cut mid-record
    log = out / "logs" / "metrics.jsonl"
    log.write_text(log.read_text()[:-25])
    capsys.readouterr()

    # issue 52: a checkpoint without its sums is refused unless --no-verify (it used to load unchecked)
    with pytest.raises(UserError, match="step-000003 has no SHA-256 sums.*--no-verify"):
        train(out, resume=True)
    capsys.readouterr()
    train(out, resume=True, verify=False)
    captured = capsys.readouterr()
    printed = captured.out
    assert ("note: skipping incomplete checkpoints step-000005 (no trainer_state.json); step-000004 "
            f"(state/model.safetensors has {size // 2:,} of {size:,} bytes)") in printed
    assert "warning: skipping checkpoint step-000003 (" in captured.err
    assert "; resuming from step-000002" in captured.err
    assert f"resuming {out} at step 2 from step-000002" in printed
    assert f"note: dropped 1 cut line of {log}" in printed
    assert_same_as_straight(out, straight)


@pytest.mark.parametrize("apart, says", [
    ("all", r"its model state keeps k_proj and v_proj apart: written by a melt-eval before 2026-11-28"),
    ("gate", r"its model state keeps the gate's a_proj and h_proj apart: written by a melt-eval before 2026-11-29"),
])
def test_a_resume_state_with_the_projections_apart_names_the_version_that_wrote_it(tmp_path, apart, says):
    """States written before k_proj|v_proj and gate_proj|up_proj were held merged (2026-11-28), or MELT's W_z|U_z
    (2026-11-29), cannot be resumed (the optimizer's state is per parameter): one line that says so, not the first
    line of torch's key listing."""
    from safetensors.torch import save_file

    out = tmp_path / "run"
    train(out, stop_after=2)
    for ckpt in (out / "checkpoints").iterdir():
        path = ckpt / "state" / "model.safetensors"
        state = load_file(path)
        if apart == "gate":  # the layout a state of 2026-11-28 holds: only the gate's two products apart
            gate = {k: v for k, v in state.items() if ".melt_gate." in k}
            state = {k: v for k, v in state.items() if k not in gate} | checkpoint_layout(gate)
        else:
            state = checkpoint_layout(state)
        save_file(state, path, metadata={"format": "pt"})  # the layout such a state holds
        record = ckpt / "trainer_state.json"  # the sizes and sums such a checkpoint recorded for its files
        state = json.loads(record.read_text())
        state["files"]["state/model.safetensors"] = path.stat().st_size
        state["sha256"]["state/model.safetensors"] = hashlib.sha256(path.read_bytes()).hexdigest()
        record.write_text(json.dumps(state))
    with pytest.raises(UserError, match=r"no checkpoint .* loads \(step-000002 \(" + says + r", which must resume it\); step-000001"):
        train(out, resume=True)


def test_a_cut_recipe_or_meta_file_is_recovered_and_both_broken_is_one_line(tmp_path, straight, capsys):
    out = tmp_path / "run"
    train(out, stop_after=2)
    recipe, meta = out / "recipe.yaml", out / META_FILE
    whole = recipe.read_text()
    recipe.write_text(whole[: len(whole) // 3])
    capsys.readouterr()
    train(out, resume=True, stop_after=3)
    assert f"using the recipe recorded in {META_FILE}" in capsys.readouterr().out
    assert recipe.read_text() == whole  # rewritten whole

    meta.write_text(meta.read_text()[:40])
    train(out, resume=True, stop_after=4)
    assert f"note: {META_FILE} is unreadable (" in capsys.readouterr().out
    assert json.loads(meta.read_text())["status"] == "running"

    recipe.write_text("target: [melt\n")
    meta.write_bytes(b"\xff\xfe{")
    with pytest.raises(UserError, match="--resume: cannot read the recipe of the run in .*recipe.yaml is unreadable") as refused:
        train(out, resume=True)
    assert "\n" not in str(refused.value)
    assert sorted(p.name for p in (out / "checkpoints").iterdir())[-1] == "step-000004"  # nothing lost
    recipe.write_text(whole)
    train(out, resume=True)
    assert_same_as_straight(out, straight)


def test_a_full_disk_during_a_save_is_one_line_and_the_run_resumes(tmp_path, straight, monkeypatch):
    from accelerate import Accelerator

    real = Accelerator.save_state
    saves = []

    def disk_fills_at_the_third_save(self, output_dir, **kwargs):
        saves.append(output_dir)
        if len(saves) == 3:
            Path(output_dir).mkdir(parents=True)
            (Path(output_dir) / "model.safetensors").write_bytes(b"\x00" * 100)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, output_dir, **kwargs)

    monkeypatch.setattr(Accelerator, "save_state", disk_fills_at_the_third_save)
    out = tmp_path / "run"
    # issue 52: the line says "no space left on device" in its own words (as it does for torch's own errors)
    with pytest.raises(UserError, match=r"could not write checkpoint step-000003: no space left on device in .*; "
                                        r"the last complete checkpoint is step-000002; free disk space"):
        train(out)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000001", "step-000002"]
    monkeypatch.undo()
    train(out, resume=True)
    assert_same_as_straight(out, straight)


# Runs in a child process: imports once, then trains in forked processes that are killed with
# SIGKILL: at a random file operation of a checkpoint save (before or after a tensor record's write,
# an fsync, the rename, a deletion of the pruning...), at a random call of any kind inside a save, or
# at a random time after a checkpoint appeared. Each round after the first resumes; the last round
# runs to the end. Prints what happened, one dict per round.
KILLER = r"""
import json, os, random, signal, sys, time
import torch
from melt_eval.errors import UserError
from melt_eval.training import run_recipe, runner

out, overrides, seed, rounds = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
KINDS = ("at a file operation of a save", "at a call inside a save", "at a random time")
FILE_CALLS = {"write_record", "write_end_of_file", "serialize_file"}  # torch.save's and safetensors' writers
FILE_TYPES = {"TextIOWrapper", "BufferedWriter", "BufferedReader", "FileIO"}


def is_file_operation(event, arg):
    if event not in ("c_call", "c_return"):
        return False
    module = getattr(arg, "__module__", None)
    owner = type(getattr(arg, "__self__", None)).__name__
    return module in ("posix", "io", "_io") or owner in FILE_TYPES or getattr(arg, "__name__", "") in FILE_CALLS


def die_inside_a_save(rng, file_operations_only):
    real, events_per_save = runner.write_checkpoint, []

    def profiled(*args, **kwargs):  # the first save counts its events, later ones die at a random one
        count, target = 0, (rng.randint(1, events_per_save[0]) if events_per_save else None)

        def hook(frame, event, arg):
            nonlocal count
            if file_operations_only and not is_file_operation(event, arg):
                return
            count += 1
            if count == target:
                os.kill(os.getpid(), signal.SIGKILL)

        sys.setprofile(hook)
        try:
            return real(*args, **kwargs)
        finally:
            sys.setprofile(None)
            events_per_save.append(count)

    runner.write_checkpoint = profiled


def newest_step():
    steps = [int(p[5:]) for p in os.listdir(os.path.join(out, "checkpoints")) if p.startswith("step-")] \
        if os.path.isdir(os.path.join(out, "checkpoints")) else []
    return max(steps, default=0)


report = []
for r in range(rounds + 1):
    rng = random.Random(seed * 1000 + r)
    kind = "final" if r == rounds else KINDS[r % 3]
    before = newest_step()
    pid = os.fork()
    if pid == 0:
        torch.set_num_threads(1)
        if kind in KINDS[:2]:
            die_inside_a_save(rng, file_operations_only=kind == KINDS[0])
        try:
            run_recipe("tiny-phase1", "tiny-random-ouro", out, overrides=overrides, resume=r > 0, progress=False)
        except UserError as exc:
            print(f"error: {exc}", flush=True)
            os._exit(2)
        except BaseException:
            import traceback
            traceback.print_exc()
            os._exit(1)
        os._exit(0)
    status = None
    if kind == "at a random time":
        while status is None and newest_step() <= before:
            done, waited = os.waitpid(pid, os.WNOHANG)
            status = waited if done else None
            time.sleep(0.01)
        if status is None:
            time.sleep(rng.uniform(0, 0.8))
            os.kill(pid, signal.SIGKILL)
    if status is None:
        _, status = os.waitpid(pid, 0)
    report.append({"round": r, "kind": kind, "killed": os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL,
                   "exit": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None, "step_before": before})
print(json.dumps(report))
"""


@pytest.mark.slow
def test_kill_9_at_random_points_of_the_save_then_resume_finishes(tmp_path, straight):
    seed = int(time.time())  # the in-save kill points follow it; printed on failure to replay them
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO)}  # the pinned thread count: another would add a note line
    proc = subprocess.run([sys.executable, "-c", KILLER, str(out), json.dumps(FAST), str(seed), "3"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"seed {seed}: {proc.stdout}{proc.stderr}"
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert all(r["killed"] for r in report[:-1]), f"seed {seed}: {report}\n{proc.stdout}{proc.stderr}"
    assert report[-1]["exit"] == 0, f"seed {seed}: {report}\n{proc.stdout}{proc.stderr}"
    assert report[-1]["step_before"] < FAST["max_steps"]  # the kills left work for the final round
    assert_same_as_straight(out, straight)
