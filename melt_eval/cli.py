"""`melt-eval` command line.

Each area of the harness owns its commands and registers them here, so this file
stays a table of contents: modeling/registry (`models`, `memory`), evaluation
(`run`, `score`, `tasks`), vLLM serving (`serve`), training (`train`), ablations and report (`ablate`,
`report`) and the CPU demo (`demo`).
"""

from __future__ import annotations

import importlib
import sys

import typer

from melt_eval.errors import UserError

app = typer.Typer(
    name="melt-eval",
    help="Train, ablate and evaluate MELT (Memory-Efficient Looped Transformer) and its baselines.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _root() -> None:
    """Train, ablate and evaluate MELT and its baselines."""


# Modules that define `register(app)`. A module that is not written yet is skipped,
# so the CLI works at every stage of the project.
COMMAND_MODULES = [
    "melt_eval.registry_cli",
    "melt_eval.evaluation.cli",
    "melt_eval.serve",
    "melt_eval.training.cli",
    "melt_eval.report.cli",
    "melt_eval.ablations",
    "melt_eval.demo",
]

for _name in COMMAND_MODULES:
    try:
        _module = importlib.import_module(_name)
    except ModuleNotFoundError as exc:  # tolerate only the area itself being absent
        if exc.name is None or not _name.startswith(exc.name):
            raise
        continue
    _module.register(app)


def main() -> None:
    """Console entry point: user errors become one line on stderr and exit code 2."""
    try:
        app()
    except UserError as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
