"""`write_report`: every table and figure from a results directory, written as files (what `melt-eval report`
and the demo write)."""

from __future__ import annotations

from pathlib import Path

from melt_eval.errors import UserError
from melt_eval.files import write_text_atomic


def write_report(results: Path, output: Path, *, latex: bool = True, markdown: bool = True, paper: bool = False,
                 plots: bool = True, plot_task: str | None = None, plots_dir: Path | None = None) -> dict:
    """Build every table (and the figures) from `results`; returns {"tables", "files", "source", "notes"}.

    Files: OUTPUT/report.md, OUTPUT/report.tex, and the figures in `plots_dir` (default OUTPUT/plots).
    """
    from melt_eval.report.plots import exit_figure, loops_figure, memory_frontier, memory_vs_accuracy
    from melt_eval.report.results import load_results
    from melt_eval.report.render import render_latex_report, render_markdown_report
    from melt_eval.report.tables import build_tables

    rs = load_results(results)
    if plot_task is not None:  # a typo must not draw an empty figure
        from melt_eval.protocol.tasks import BENCHMARKS
        from melt_eval.report.paper import canonical_task

        known = set(BENCHMARKS) | {t for _, t in rs.main} | {r.task for r in rs.every}
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
        files += memory_frontier(rs, plots_dir, task=task)
        files += exit_figure(rs, plots_dir)  # beyond the paper; only where there are --exit runs
    notes = [f"unfinished run skipped: {p}" for p in rs.unfinished] + [f"unreadable: {u}" for u in rs.unreadable]
    return {"tables": tables, "files": files, "source": "paper" if rs.empty else "results", "notes": notes}


def _write(path: Path, text: str) -> Path:
    write_text_atomic(path, text)
    return path
