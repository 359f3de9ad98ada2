"""`melt-eval` command line.

Each area of the harness owns its commands in a command module with `register(app)`, so this file
stays a table of contents: the model registry (`models`), evaluation (`run`, `score`, `tasks`), vLLM
serving (`serve`), training (`train`), the report (`report`, `memory`) and the experiments (`ablate`,
`demo`). Library modules never import typer; only these command modules do.
"""

from __future__ import annotations

import sys

import typer

from melt_eval import serve
from melt_eval.errors import UserError
from melt_eval.evaluation import cli as evaluation_cli
from melt_eval.experiments import cli as experiments_cli
from melt_eval.modeling import cli as modeling_cli
from melt_eval.report import cli as report_cli
from melt_eval.training import cli as training_cli

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


for _commands in (modeling_cli, evaluation_cli, serve, training_cli, report_cli, experiments_cli):
    _commands.register(app)


def main() -> None:
    """Console entry point: user errors become one line on stderr and exit code 2."""
    try:
        app()
    except UserError as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
