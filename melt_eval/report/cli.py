"""`melt-eval report` and `melt-eval memory`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from melt_eval.errors import UserError
from melt_eval.files import write_text_atomic


def write_report(results: Path, output: Path, *, latex: bool = True, markdown: bool = True, paper: bool = False,
                 plots: bool = True, plot_task: str | None = None, plots_dir: Path | None = None) -> dict:
    """Build every table (and the figures) from `results`; returns {"tables", "files", "source", "notes"}.

    Files: OUTPUT/report.md, OUTPUT/report.tex, and the figures in `plots_dir` (default OUTPUT/plots).
    """
    from melt_eval.report.plots import loops_figure, memory_vs_accuracy
    from melt_eval.report.results import load_results
    from melt_eval.report.tables import build_tables, render_latex_report, render_markdown_report

    rs = load_results(results)
    if plot_task is not None:  # a typo must not draw an empty figure
        from melt_eval.evaluation.tasks import SPECS
        from melt_eval.report.paper import canonical_task

        known = set(SPECS) | {t for _, t in rs.main} | {r.task for r in rs.every}
        if (canonical_task(plot_task) or plot_task) not in known:
            raise UserError(f"--plot-task {plot_task!r} is not a task; choose one of {', '.join(sorted(known))}")
        plot_task = canonical_task(plot_task) or plot_task
    tables = build_tables(rs, compare=paper)
    output.mkdir(parents=True, exist_ok=True)
    files = []
    if markdown:
        files.append(_write(output / "report.md", render_markdown_report(tables)))
    if latex:
        files.append(_write(output / "report.tex", render_latex_report(tables)))
    if plots:
        task = plot_task or ("math500" if any(t == "math500" for _, t in rs.main) or rs.empty else
                             next((t for _, t in rs.main), "math500"))
        plots_dir = plots_dir or output / "plots"
        files += memory_vs_accuracy(rs, plots_dir, task=task)
        files += loops_figure(rs, plots_dir)
    notes = [f"unfinished run skipped: {p}" for p in rs.unfinished] + [f"unreadable: {u}" for u in rs.unreadable]
    return {"tables": tables, "files": files, "source": "paper" if rs.empty else "results", "notes": notes}


def _write(path: Path, text: str) -> Path:
    write_text_atomic(path, text)
    return path


def print_tables(tables) -> None:
    """Each table as a rich table: bold best, underlined second, the paper's figure dimmed beside ours."""
    from rich.console import Console
    from rich.table import Table as RichTable
    from rich.text import Text

    from melt_eval.report.tables import NA, heading, paper_beside

    console = Console()
    for t in tables:
        rt = RichTable(title=heading(t), title_style="bold", show_lines=False)
        for h in t.stub_heads:
            rt.add_column(h)
        k = 0
        for g, span in t.groups or [("", len(t.heads))]:
            for h in t.heads[k : k + span]:
                rt.add_column(f"{g}\n{h}" if g and span > 1 else (g or h), justify="right")
            k += span
        for r in t.rows:
            if r.rule_before:
                rt.add_section()
            cells = []
            for c in r.cells:
                shown = c.shown()
                text = Text(NA if shown is None else shown, style="dim" if shown is None else
                            "bold" if c.bold else "underline" if c.underline else "")
                if shown is not None and c.stderr is not None:
                    text.append(f" ±{c.stderr:.{c.digits}f}", style="dim")
                if (beside := paper_beside(c)) is not None:
                    text.append(f" ({beside})", style="cyan")
                cells.append(text)
            stub = [Text(s, style="bold" if r.shaded else "") for s in r.stub]
            rt.add_row(*stub, *cells, style="on grey15" if r.shaded else None)
        console.print(rt)
        if t.compare:
            console.print("Each cell: ours (paper, Δ = ours − paper).", style="cyan")
        for n in t.notes:
            console.print(f"- {n}", soft_wrap=True)
        console.print()


def register(app: typer.Typer) -> None:
    @app.command()
    def report(
        latex: bool = typer.Option(False, "--latex", help="Write report.tex (booktabs, compiles standalone)."),
        markdown: bool = typer.Option(False, "--markdown", help="Write report.md."),
        results: Optional[Path] = typer.Option(None, "--results", help="Results root written by run/ablate (default results/)."),
        paper: bool = typer.Option(False, "--paper", help="Print the paper's figure and the difference beside each value."),
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
        for flag, path in (("--output", output), ("--plots-dir", plots_dir)):
            if path is not None and path.exists() and not path.is_dir():
                raise UserError(f"{flag} {path} is a file; pass a directory")
        out = write_report(results, output or results / "report", latex=latex, markdown=markdown, paper=paper,
                           plots=plots, plot_task=plot_task,
                           plots_dir=plots_dir or (None if output else Path("plots")))
        print_tables(out["tables"])
        if out["source"] == "paper":
            typer.echo(f"No results under {results}: these are the paper's own tables.")
        for note in out["notes"]:
            typer.echo(note)
        for f in out["files"]:
            typer.echo(f"wrote {f}")

    @app.command()
    def memory(
        models: Optional[str] = typer.Option(None, "--models", help="Comma-separated registry names (default: the paper's)."),
        context: str = typer.Option("32000,32768", "--context", help="Token counts, comma-separated."),
        fmt: str = typer.Option("table", "--format", help="table | json | latex"),
        measure: str = typer.Option("analytic", "--measure", help="analytic | vllm (read the KV size vLLM allocates)."),
    ) -> None:
        """KV-cache bytes per token, model bytes, KV and total memory per context; the paper's figures beside."""
        from melt_eval.report import memory as mem

        if fmt not in ("table", "json", "latex"):
            raise UserError(f"--format must be table, json or latex, got {fmt!r}")
        if measure not in ("analytic", "vllm"):
            raise UserError(f"--measure must be analytic or vllm, got {measure!r}")
        try:
            contexts = tuple(int(c) for c in context.split(",") if c.strip())
        except ValueError:
            raise UserError(f"--context takes integers separated by commas, got {context!r}") from None
        names = [m.strip() for m in models.split(",") if m.strip()] if models else None
        rows = mem.memory_table(names, contexts)
        if measure == "vllm":
            measured = mem.measure_with_vllm([r.model for r in rows])
            for r in rows:
                r.measured = measured.get(r.model)
        if fmt == "json":
            typer.echo(json.dumps(mem.to_json(rows), indent=2))
        elif fmt == "latex":
            typer.echo(mem.render_latex(rows, contexts))
        else:
            mem.render_rich(rows, contexts)
