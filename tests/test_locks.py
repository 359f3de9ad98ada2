"""One writer per directory: results task directories and training outputs are locked; a second
writer (or `--force` during a run) is refused naming the holder's PID, a killed holder's lock is
taken over. Recipe YAML refuses aliases (an alias bomb is a one-line error, not a hang)."""

from __future__ import annotations

import fcntl
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from typer.testing import CliRunner

from melt_eval.cli import app
from melt_eval.errors import UserError
from melt_eval.evaluation import RunPaths, run_tasks
from melt_eval.generation.options import InferenceOptions, Sampling
from melt_eval.files import LOCK_NAME, DirLock
from melt_eval.training import load_recipe, run_recipe

REPO = Path(__file__).resolve().parents[1]
ONE_SAMPLE = InferenceOptions(sampling=Sampling(samples=1, max_new_tokens=2))
SEED_1 = InferenceOptions(sampling=Sampling(samples=1, max_new_tokens=2, seed=1))
TINY_EVAL = dict(max_problems=2, progress=False)
FAST_TRAIN = {"seq_len": 64, "micro_batch_size": 4, "batch_tokens": 256, "warmup_steps": 1, "max_steps": 1,
              "data": [{"source": "synthetic", "n": 100, "num_steps": 1}], "tensorboard": False}

# The holder is another process running the real DirLock. It loads melt_eval.files without the
# package's __init__ (which imports torch), so it is up in a fraction of a second.
HOLDER = """
import sys, time, types
package = types.ModuleType("melt_eval"); package.__path__ = [sys.argv[1]]; sys.modules["melt_eval"] = package
from melt_eval.files import DirLock
DirLock(sys.argv[2], sys.argv[3]).acquire()
print("locked", flush=True)
time.sleep(600)
"""


@pytest.fixture
def holder():
    """holder(directory, what) -> a running process that holds the directory's lock."""
    procs = []

    def start(directory: Path, what: str = "evaluation") -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(REPO / "melt_eval"), str(directory), what],
                                stdout=subprocess.PIPE, text=True)
        procs.append(proc)
        assert proc.stdout.readline().strip() == "locked"
        return proc

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


def kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def test_a_second_writer_is_refused_and_a_killed_holders_lock_is_taken_over(tmp_path, holder):
    target = tmp_path / "results" / "m" / "aime24"
    proc = holder(target)
    with pytest.raises(UserError) as refused:
        DirLock(target, "evaluation").acquire()
    message = str(refused.value)
    assert f"PID {proc.pid}" in message and "another evaluation" in message and "\n" not in message

    kill(proc)  # kill -9: the lock file stays, naming a dead PID; the kernel has dropped the lock
    assert json.loads((target / LOCK_NAME).read_text())["pid"] == proc.pid
    with DirLock(target, "evaluation") as lock:
        assert lock.previous["pid"] == proc.pid
        assert json.loads((target / LOCK_NAME).read_text())["pid"] == os.getpid()
        with pytest.raises(UserError, match=f"PID {os.getpid()}"):  # even the same process cannot write twice
            DirLock(target, "evaluation").acquire()
    assert not (target / LOCK_NAME).exists() and target.is_dir()


def test_a_writer_refused_while_the_holder_writes_its_record_still_names_its_pid(tmp_path):
    """The race CI hit: the second writer is refused between the holder's flock and its record write."""
    tmp_path.joinpath(LOCK_NAME).write_text(json.dumps({"pid": 2**22 + 7, "host": socket.gethostname()}))  # a dead holder's
    fd = os.open(tmp_path / LOCK_NAME, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # locked; the record still names the dead holder, then none

    def write_record():
        os.ftruncate(fd, 0)
        threading.Event().wait(0.3)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode(), 0)

    writer = threading.Thread(target=write_record)
    writer.start()
    try:
        with pytest.raises(UserError, match=f"another evaluation \\(PID {os.getpid()}\\)"):
            DirLock(tmp_path, "evaluation").acquire()
    finally:
        writer.join()
        os.close(fd)


def test_a_lock_leaves_no_directories_behind_and_refuses_a_file(tmp_path):
    with DirLock(tmp_path / "a" / "b" / "c", "training run"):
        assert (tmp_path / "a" / "b" / "c" / LOCK_NAME).is_file()
    assert not (tmp_path / "a").exists()  # a refused or failed writer leaves nothing
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match="is a file"):
        DirLock(tmp_path / "file", "training run").acquire()
    with pytest.raises(UserError, match="part of that path is a file"):
        DirLock(tmp_path / "file" / "sub", "training run").acquire()


def test_run_into_a_locked_task_directory_is_refused_even_with_force(tmp_path, holder):
    task_dir = tmp_path / "tiny-random-ouro" / "synthetic"
    proc = holder(task_dir)
    # a second identical run while the first is writing: refused before writing anything
    with pytest.raises(UserError, match=re.escape(f"{task_dir} is being written by another evaluation (PID {proc.pid}")):
        run_tasks("synthetic", "tiny-random-ouro", ONE_SAMPLE, RunPaths(output=tmp_path), **TINY_EVAL)
    assert sorted(p.name for p in task_dir.iterdir()) == [LOCK_NAME]
    kill(proc)
    [first] = run_tasks("synthetic", "tiny-random-ouro", ONE_SAMPLE, RunPaths(output=tmp_path), **TINY_EVAL)  # stale lock taken over
    assert first["finished"] and len((task_dir / "completions.jsonl").read_text().splitlines()) == 2
    assert not (task_dir / LOCK_NAME).exists()

    before = {p.name: p.read_bytes() for p in task_dir.iterdir() if p.is_file()}
    proc = holder(task_dir)
    with pytest.raises(UserError, match=f"PID {proc.pid}"):  # --force during another run
        run_tasks("synthetic", "tiny-random-ouro", SEED_1, RunPaths(output=tmp_path), force=True, **TINY_EVAL)
    assert {p.name: p.read_bytes() for p in task_dir.iterdir() if p.is_file() and p.name != LOCK_NAME} == before
    kill(proc)
    [forced] = run_tasks("synthetic", "tiny-random-ouro", SEED_1, RunPaths(output=tmp_path), force=True, **TINY_EVAL)
    assert forced["settings"]["seed"] == 1 and len((task_dir / "completions.jsonl").read_text().splitlines()) == 2


def test_train_into_a_locked_output_is_refused_in_one_line(tmp_path, holder):
    out = tmp_path / "run"
    proc = holder(out, "training run")
    result = CliRunner().invoke(app, ["train", "--recipe", "pretrain-tiny", "--from", "tiny-random-ouro", "--output", str(out),
                                      "--max-steps", "1", "--no-progress"])
    assert isinstance(result.exception, UserError)
    assert f"is being written by another training run (PID {proc.pid}" in str(result.exception)
    assert sorted(p.name for p in out.iterdir()) == [LOCK_NAME]  # nothing of the refused run was written
    kill(proc)
    run_recipe("pretrain-tiny", "tiny-random-ouro", out, overrides=FAST_TRAIN, progress=False)
    assert json.loads((out / "melt_eval_training.json").read_text())["status"] == "finished"
    assert not (out / LOCK_NAME).exists()


@pytest.mark.slow
def test_two_identical_runs_at_once_do_not_both_write(tmp_path):
    """The issue's case: two `melt-eval run`s into one directory; before locks: 60 lines for 30 problems."""
    cmd = [sys.executable, "-m", "melt_eval.cli", "run", "synthetic", "--model", "tiny-random-ouro", "--samples", "2",
           "--max-problems", "30", "--max-new-tokens", "8", "--output", str(tmp_path), "--no-progress"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}  # the pinned thread count: another would add a note line
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outcomes = [(p.wait(timeout=600), p.stderr.read()) for p in procs]
    lines = (tmp_path / "tiny-random-ouro" / "synthetic" / "completions.jsonl").read_text().splitlines()
    assert len(lines) == 30 and len({json.loads(line)["key"] for line in lines}) == 30
    assert sorted(code for code, _ in outcomes)[0] == 0
    # either the second was refused (one line naming the first's PID) or it started after the first had finished
    for code, err in outcomes:
        if code != 0:
            assert code == 2 and "is being written by another evaluation (PID" in err and len(err.strip().splitlines()) == 1


ALIAS_BOMB = """\
model_overrides:
  a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]
  b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]
  c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]
  d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c]
  e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d]
  f: &f [*e, *e, *e, *e, *e, *e, *e, *e, *e]
  g: &g [*f, *f, *f, *f, *f, *f, *f, *f, *f]
  h: &h [*g, *g, *g, *g, *g, *g, *g, *g, *g]
data: [*h, *h, *h, *h, *h, *h, *h, *h, *h]
"""


@pytest.mark.timeout(60)
def test_a_yaml_alias_bomb_is_refused_at_once(tmp_path):
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(ALIAS_BOMB)
    with pytest.raises(UserError, match=r"bomb.yaml is not valid YAML \(YAML aliases \(\*a\) are not allowed in recipes at line 3"):
        load_recipe("tiny-phase1", config_file=bomb)
    result = CliRunner().invoke(app, ["train", "--recipe", "tiny-phase1", "--from", "tiny-random-ouro", "--output",
                                      str(tmp_path / "out"), "--config", str(bomb), "--set", "max_steps=1"])
    assert isinstance(result.exception, UserError) and "aliases" in str(result.exception)
    with pytest.raises(UserError, match="--set data is not valid YAML"):
        CliRunner().invoke(app, ["train", "--output", str(tmp_path / "out"), "--set", "data=[&x [1, 2], *x, *x]"],
                           catch_exceptions=False)
    assert not (tmp_path / "out").exists()
