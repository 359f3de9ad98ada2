"""Issue 69 item 4: `melt-eval train --nproc-per-node N`, the harness's own launch of several processes.

What it can check it checks before any worker starts (each case here is refused with start_workers replaced by a
failure); what only the workers find is said once, without the launcher's traceback. The launcher itself is
PyTorch's: the mapping of its outcomes (a refusal on every rank, a rank killed, Ctrl-C) is tested here with its
`elastic_launch` replaced, and one real 2-process launch whose workers refuse ends the file
(tests/test_train_distributed.py trains with it and compares with one process).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from melt_eval import float_path
from melt_eval.cli import app, main
from melt_eval.files import DirLock
from melt_eval.training import launch, launcher
from melt_eval.training.config import load_recipe

REPO = Path(__file__).resolve().parents[1]
FAST = {"seq_len": 64, "micro_batch_size": 4, "batch_tokens": 512, "warmup_steps": 1, "max_steps": 2,
        "data": [{"source": "synthetic", "n": 100, "num_steps": 1}], "tensorboard": False, "interpolation_steps": 0}
SETS = [a for k, v in FAST.items() for a in ("--set", f"{k}={json.dumps(v)}")]


def train_args(out: Path, *more: str, nproc: str = "2") -> list[str]:
    return ["train", "--recipe", "tiny-phase1", "--from", "tiny-random-ouro", "--output", str(out), "--no-progress",
            *SETS, "--nproc-per-node", nproc, *more]


def run(monkeypatch, capsys, args: list[str]) -> tuple[int, str]:
    monkeypatch.setattr(sys, "argv", ["melt-eval", *args])
    with pytest.raises(SystemExit) as exit_:
        main()
    return exit_.value.code, capsys.readouterr().err.strip()


@pytest.fixture
def no_workers(monkeypatch):
    def start(*args, **kwargs):
        raise AssertionError("workers were started")

    monkeypatch.setattr(launcher, "start_workers", start)


def a_run(out: Path, *, status: str = "running", world: int | None = None) -> None:
    """A run directory as the runner leaves it (recipe.yaml, its record; a complete checkpoint of `world`)."""
    recipe = load_recipe("tiny-phase1", overrides={**FAST, "from_model": "tiny-random-ouro"})
    out.mkdir(parents=True)
    (out / "recipe.yaml").write_text(yaml.safe_dump(recipe.to_dict(), sort_keys=False))
    (out / "melt_eval_training.json").write_text(json.dumps({"status": status, "recipe": recipe.to_dict()}))
    if world is not None:
        ckpt = out / "checkpoints" / "step-000001"
        ckpt.mkdir(parents=True)
        (ckpt / "trainer_state.json").write_text(json.dumps({"step": 1, "tokens_seen": 512, "data": {}, "files": {},
                                                             "world_size": world}))


CASES = {  # name: (prepare(out, monkeypatch), extra arguments, words of the line, whether the directory is left)
    "lock held": (lambda out, mp: None, [], ["is being written by another training run"], False),
    "a run there": (lambda out, mp: a_run(out), [], ["already holds a training run", "--resume"], True),
    "finished": (lambda out, mp: a_run(out, status="finished"), ["--resume"], ["has already finished"], True),
    "another count": (lambda out, mp: a_run(out, world=4), ["--resume"],
                      ["written by 4 processes", "this run has 2", "--nproc-per-node 4"], True),
    "captured": (lambda out, mp: None, ["--set", "compile=captured"], ["compile: captured", "compile: true"], False),
    "fsdp on cpus": (lambda out, mp: mp.setenv("ACCELERATE_USE_FSDP", "true"), [],
                     ["asks for FSDP", "on CPUs drop the FSDP config"], False),
    "under torchrun": (lambda out, mp: mp.setenv("WORLD_SIZE", "2"), [], ["starts the processes itself"], False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_refused_before_any_worker_starts(tmp_path, monkeypatch, capsys, no_workers, case):
    prepare, more, words, left = CASES[case]
    out = tmp_path / "run"
    prepare(out, monkeypatch)
    if case == "lock held":
        with DirLock(out, "training run"):
            code, err = run(monkeypatch, capsys, train_args(out, *more))
    else:
        code, err = run(monkeypatch, capsys, train_args(out, *more))
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("error: "), err
    assert all(w in err for w in words), err
    assert out.exists() == left and not (out / ".melt-eval.lock").exists()


def test_a_process_count_below_one_is_refused(tmp_path, monkeypatch, capsys, no_workers):
    code, err = run(monkeypatch, capsys, train_args(tmp_path / "run", nproc="0"))
    assert code == 2 and err == "error: --nproc-per-node must be at least 1, got 0"


def test_the_workers_get_the_arguments_as_given():
    """The workers' command line parses to the same values as the launch's, less --nproc-per-node (values that
    start with '-', paths, repeated and negative flags included)."""
    import typer.main

    command = typer.main.get_command(app).commands["train"]
    given = ["--recipe", "tiny-phase1", "--from", "tiny-random-ouro", "-o", "runs/x", "--no-kd", "--no-verify",
             "--set", "seed=-3", "--set", "max_steps=2", "--log-with", "tensorboard", "--log-with", "mlflow",
             "--hub-model-id", "-odd", "--align-beta", "0.1", "--nproc-per-node", "2", "--resume"]
    ctx = command.make_context("train", list(given))
    args = launcher.worker_args(ctx)
    assert not any("nproc" in a for a in args) and "--hub-model-id=-odd" in args
    again = command.make_context("train", list(args))
    assert again.params == {**ctx.params, "nproc_per_node": None}


class FakeLaunch:
    """Stands for PyTorch's elastic_launch: records what the workers would get, then ends as told."""

    def __init__(self, outcome: str):
        self.outcome, self.seen = outcome, {}

    def __call__(self, config, entrypoint):
        def start(*args):
            from torch.distributed.elastic.multiprocessing.api import SignalException
            from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

            self.seen = {"nproc": config.nproc_per_node, "max_restarts": config.max_restarts, "entry": entrypoint,
                         "args": list(args), "threads": os.environ.get("OMP_NUM_THREADS"),
                         "errors": os.environ.get(launch.LAUNCH_ERRORS)}
            failure = lambda rank, code: ProcessFailure(local_rank=rank, pid=1, exitcode=code, error_file="/nonexistent")
            if self.outcome == "refuse":  # every rank refuses alike, as on_main makes them
                for rank in (1, 0):
                    os.environ["RANK"] = str(rank)
                    assert launch.worker_refusal("the same one line")
                del os.environ["RANK"]
                raise ChildFailedError("melt_eval.cli", {0: failure(0, 2), 1: failure(1, 2)})
            if self.outcome == "kill":
                raise ChildFailedError("melt_eval.cli", {1: failure(1, -signal.SIGKILL)})
            if self.outcome == "ctrl-c":
                raise SignalException("SIGINT", signal.SIGINT)

        return start


@pytest.fixture
def fake_launch(monkeypatch):
    import torch.distributed.launcher.api as api

    def use(outcome: str) -> FakeLaunch:
        fake = FakeLaunch(outcome)
        monkeypatch.setattr(api, "elastic_launch", fake)
        return fake

    return use


def test_a_refusal_on_every_rank_is_said_once(tmp_path, monkeypatch, capsys, fake_launch):
    fake = fake_launch("refuse")
    code, err = run(monkeypatch, capsys, train_args(tmp_path / "run", "--no-kd"))
    assert (code, err) == (2, "error: the same one line")
    assert fake.seen["nproc"] == 2 and fake.seen["max_restarts"] == 0 and fake.seen["entry"] == sys.executable
    assert fake.seen["args"][:4] == ["-u", "-m", "melt_eval.cli", "train"] and "--no-kd" in fake.seen["args"]
    assert not Path(fake.seen["errors"]).exists()  # the launch's folder (under MELT_EVAL_HOME) is removed
    assert Path(fake.seen["errors"]).is_relative_to(os.environ["MELT_EVAL_HOME"])
    assert launch.LAUNCH_ERRORS not in os.environ


def test_a_killed_rank_is_one_line_saying_what_to_run(tmp_path, monkeypatch, capsys, fake_launch):
    fake_launch("kill")
    code, err = run(monkeypatch, capsys, train_args(tmp_path / "run"))
    assert code == 1 and err == ("error: process 1 of 2 was killed by SIGKILL; nothing was written yet; run the same "
                                 "command again (without --resume)"), err


def test_ctrl_c_is_one_line(tmp_path, monkeypatch, capsys, fake_launch):
    from melt_eval import interrupts

    for name in ("_requested", "_reported"):  # this process's Ctrl-C record, restored after the test
        monkeypatch.setattr(interrupts, name, False)
    fake_launch("ctrl-c")
    code, err = run(monkeypatch, capsys, train_args(tmp_path / "run"))
    assert code == 130 and len(err.splitlines()) == 1 and err.startswith("interrupted: "), err


@pytest.mark.parametrize("user, nproc, workers", [(None, "2", "1"), ("3", "2", "3"), (None, "1", None)])
def test_workers_get_torchruns_threads(tmp_path, monkeypatch, capsys, fake_launch, user, nproc, workers):
    """torchrun's rule, unchanged: 1 thread per worker of several unless the user set OMP_NUM_THREADS; the
    command line's own pin (2) is not the user's setting. One worker pins its own, as under torchrun."""
    monkeypatch.setenv("OMP_NUM_THREADS", user or "2")
    monkeypatch.setenv(float_path.SET_BY_PIN, "ATEN_CPU_CAPABILITY,MKL_CBWR" + ("" if user else ",OMP_NUM_THREADS"))
    fake = fake_launch("ok")
    code, _ = run(monkeypatch, capsys, train_args(tmp_path / "run", nproc=nproc))
    assert code == 0 and fake.seen["threads"] == workers
    assert os.environ["OMP_NUM_THREADS"] == (user or "2")  # the launch's own environment is left as it was


def test_a_refusal_only_the_workers_find_is_one_line(tmp_path):
    """Two real workers, an unknown --from (found when the model loads): one `error:` line, exit 2, no traceback
    from the launcher or from the rank left waiting at the barrier. Nothing else either: the workers run on
    torchrun's one thread, and rank 0's note that this leaves the pinned float path came first (2 lines, issue 69
    hostile round 6: a one-process run that took the directory between the launch's check and the workers); it
    is said once the run has passed its checks."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    args = train_args(tmp_path / "run")
    args[args.index("tiny-random-ouro")] = "nosuch-model"
    done = subprocess.run([sys.executable, "-m", "melt_eval.cli", *args], env=env, capture_output=True, text=True,
                          timeout=600)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert done.returncode == 2 and len(errors) == 1 and "unknown model 'nosuch-model'" in errors[0], done.stderr
    assert done.stderr.splitlines() == errors, done.stderr
    assert "Traceback" not in done.stderr and "ChildFailedError" not in done.stderr, done.stderr
    assert not (tmp_path / "run").exists()
