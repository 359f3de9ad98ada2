"""Issue 69 item 8: torch.compile's Inductor cache lives under MELT_EVAL_HOME (not /tmp/torchinductor_<user>),
unless the user set Inductor's own TORCHINDUCTOR_CACHE_DIR. Read as Inductor reads it, in a fresh process that
starts as the command line does; nothing is compiled."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROBE = ("import melt_eval.cli\n"
         "from torch._inductor.runtime.cache_dir_utils import cache_dir\n"
         "print(cache_dir())\n")


def inductor_dir(env: dict) -> str:
    base = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    done = subprocess.run([sys.executable, "-c", PROBE], env={**base, **env}, cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()[-1]


def test_inductor_caches_under_the_harness_home(tmp_path):
    home = tmp_path / "home"
    assert inductor_dir({"MELT_EVAL_HOME": str(home)}) == str(home / "torchinductor")


def test_the_users_own_inductor_directory_wins(tmp_path):
    mine = tmp_path / "mine"
    assert inductor_dir({"MELT_EVAL_HOME": str(tmp_path / "home"), "TORCHINDUCTOR_CACHE_DIR": str(mine)}) == str(mine)


def test_the_training_runner_sets_it_for_python_callers(monkeypatch, tmp_path):
    """run_recipe without the command line: train() sets it first, before anything compiles (a user's value kept)."""
    import pytest

    from melt_eval import compile_cache
    from melt_eval.training import load_recipe, runner

    class Stop(Exception):
        pass

    def stop(*args, **kwargs):
        raise Stop

    monkeypatch.setattr(runner, "accelerator_kwargs", stop)  # the first thing train() does after it
    monkeypatch.setenv("MELT_EVAL_HOME", str(tmp_path))
    for users, expected in ((None, str(tmp_path / "torchinductor")), ("/elsewhere", "/elsewhere")):
        if users is None:
            monkeypatch.delenv(compile_cache.VARIABLE, raising=False)
        else:
            monkeypatch.setenv(compile_cache.VARIABLE, users)
        with pytest.raises(Stop):
            runner.train(load_recipe("tiny-phase1"), tmp_path / "run")
        assert os.environ[compile_cache.VARIABLE] == expected
