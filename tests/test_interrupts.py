"""Ctrl-C where no command has its own handling: still one line and exit 130 (melt_eval/interrupts.py).
Ctrl-C in training, at random moments and after a library lost it: tests/test_train_hardening.py."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

from melt_eval import interrupts

from helpers import main_exit_code as _main


@pytest.fixture(autouse=True)
def no_ctrl_c_yet(monkeypatch):
    monkeypatch.setattr(interrupts, "_requested", False)
    monkeypatch.setattr(interrupts, "_reported", False)


class _CtrlCInDumps:
    @staticmethod
    def dumps(*args, **kwargs):
        interrupts._remember_and_raise(signal.SIGINT, None)


def test_ctrl_c_in_a_command_without_its_own_handling_is_one_line(monkeypatch, capsys):
    from melt_eval.evaluation import cli as evaluation_cli

    monkeypatch.setattr(evaluation_cli, "json", _CtrlCInDumps)  # typer alone would exit 130 without a word
    assert _main(["tasks", "--format", "json"]) == 130
    assert capsys.readouterr().err.strip() == "interrupted: stopped at Ctrl-C"


def test_an_error_without_ctrl_c_stays_an_error(monkeypatch):
    from melt_eval.evaluation import cli as evaluation_cli

    class Broken:
        @staticmethod
        def dumps(*args, **kwargs):
            raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(evaluation_cli, "json", Broken)
    with pytest.raises(RecursionError):
        _main(["tasks", "--format", "json"])


def test_a_caught_interrupt_inside_string_exec_keeps_exit_130_under_python_m(tmp_path):
    """CPython marks a KeyboardInterrupt that ends exec'd source as unhandled; `python -m` then dies by SIGINT."""
    (tmp_path / "ctrl_c_in_exec.py").write_text(textwrap.dedent("""
        import sys
        from melt_eval import interrupts
        try:
            exec("raise KeyboardInterrupt")
        except KeyboardInterrupt:
            interrupts.handled()
            sys.exit(130)
    """))
    done = subprocess.run([sys.executable, "-m", "ctrl_c_in_exec"], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 130, done.stderr


def test_ctrl_c_while_typer_builds_the_commands_is_one_line(monkeypatch, capsys):
    import typer.main

    def building(*args, **kwargs):
        interrupts._remember_and_raise(signal.SIGINT, None)

    monkeypatch.setattr(typer.main, "get_command", building)  # outside typer's own KeyboardInterrupt handling
    assert _main(["tasks"]) == 130
    assert capsys.readouterr().err.strip() == "interrupted: stopped at Ctrl-C"
