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
