"""Helpers shared by test modules (fixtures live in conftest.py)."""

import sys


def main_exit_code(args: list[str]) -> int:
    """Run the `melt-eval` console entry point as a user would; returns its exit code."""
    from melt_eval.cli import main

    old, sys.argv = sys.argv, ["melt-eval", *[str(a) for a in args]]
    try:
        main()
    except SystemExit as exc:
        return exc.code
    finally:
        sys.argv = old
    return 0


def queued_job(log: str, name: str, wait_for: str | None = None) -> None:
    """A job for `ablations._run_side_by_side` (picklable, runs in a worker process): appends
    "start NAME" and "end NAME" to `log`; in between waits, up to 60 s, for "start WAIT_FOR"."""
    import time
    from pathlib import Path

    def mark(event: str) -> None:
        with open(log, "a") as f:
            f.write(f"{event} {name}\n")

    mark("start")
    deadline = time.monotonic() + 60
    while wait_for and f"start {wait_for}" not in Path(log).read_text().split("\n"):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name}: {wait_for} never started beside it")
        time.sleep(0.05)
    mark("end")


def one_line_error(capsys, code: int, *fragments: str) -> str:
    """The CLI's refusal: exit 2 and exactly one stderr line, "error: ...", holding every fragment."""
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    assert all(f in err for f in fragments), err
    return err


def refused_load(path, *fragments) -> str:
    """`load_model(path)` refuses with a one-line UserError holding every fragment; returns the message."""
    import pytest

    from melt_eval.errors import UserError
    from melt_eval.modeling import load_model

    with pytest.raises(UserError) as exc:
        load_model(str(path))
    message = str(exc.value)
    assert "\n" not in message and all(f in message for f in fragments), message
    return message


def copy_checkpoint(tiny_dirs, tmp_path, name="tiny-random-ouro"):
    """A copy of one of the `tiny_dirs` checkpoints under tmp_path/ckpt, for a test to damage."""
    import shutil

    target = tmp_path / "ckpt"
    shutil.copytree(tiny_dirs[name], target)
    return target


def checkpoint_layout(state: dict) -> dict:
    """A model state dict (a resume state's) named as checkpoints name it: the model holds k|v, gate|up and MELT's
    W_z|U_z as one weight each, checkpoints keep the halves apart (`looplm.CHECKPOINT_LAYOUT`)."""
    from melt_eval.modeling.looplm import checkpoint_parts

    out = {}
    for name, tensor in state.items():
        names, dim = checkpoint_parts(name)
        out |= {part: half.clone() for part, half in zip(names, tensor.chunk(len(names), dim=dim))}
    return out
