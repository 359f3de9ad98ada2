"""`melt-eval models`: the model registry (melt_eval/registry.py)."""

from __future__ import annotations

import json
from enum import Enum

import typer
from rich.console import Console
from rich.table import Table

from melt_eval.registry import MODELS


class Format(str, Enum):
    table = "table"
    json = "json"


# Width of a console writing into a pipe or a file: wide enough that no cell is cut.
PIPE_WIDTH = 10_000


def models(fmt: Format = typer.Option(Format.table, "--format", help="table | json.")) -> None:
    """List the known models: source and architecture facts."""
    rows = [spec.as_dict() for spec in MODELS.values()]
    if fmt is Format.json:
        typer.echo(json.dumps(rows, indent=2))
        return
    console = Console(width=None if Console().is_terminal else PIPE_WIDTH)
    table = Table(title="melt-eval models")
    for col in ("name", "family", "source", "layers", "heads", "kv heads", "head dim", "params", "loops", "KV entries/layer", "KV B/token"):
        table.add_column(col, justify="right" if col not in ("name", "family", "source") else "left")
    for r in rows:
        table.add_row(
            r["name"], r["family"], r["source"], *(_cell(r[k]) for k in ("num_layers", "num_heads", "num_kv_heads", "head_dim")), f"{r['params'] / 1e9:.3f}B" if r["params"] else "tiny", str(r["loops"]),
            str(r["kv_entries_per_layer"]), f"{r['kv_bytes_per_token']:,}" + ("*" if r["kv_source"] != "analytic" else ""),
        )
    console.print(table)
    console.print("* the paper's vLLM reading (not derivable from a plain attention config)")


def _cell(value) -> str:
    return "-" if value is None else str(value)


def register(app: typer.Typer) -> None:
    app.command("models")(models)
