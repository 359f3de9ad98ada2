"""The paper's figure and the loops figure (matplotlib, no display needed).

memory_vs_accuracy: x = total memory for a 32k-token generation (model + KV cache, GB, bf16, the
paper's arithmetic), y = MATH-500 accuracy; the paper's points hollow, reproduced points filled,
MELT in colour. For a task outside the paper (the demo's `synthetic`) x is the KV cache the engine
measured (`peak_cache_bytes` of the run), since tiny models have no paper figures.

loops: accuracy and KV-cache memory against the number of loops T used at inference (`run --loops`),
one line per model; memory is the measured peak cache of each run.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from melt_eval.registry import MODELS
from melt_eval.report.memory import GB, MB, memory_row
from melt_eval.report.paper import MAIN_MODELS, paper_memory, paper_results
from melt_eval.report.results import ResultSet

MELT_COLOUR, OTHER_COLOUR = "#d62728", "#1f77b4"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _is_melt(name: str) -> bool:
    return "melt" in name.lower()


def _first_metric(result) -> float | None:
    for name in ("accuracy", "pass@1"):
        got = result.metric(name)
        if got is not None:
            return 100 * got[0]
    return None


def memory_vs_accuracy(rs: ResultSet, out_dir: Path, task: str = "math500", paper: bool = True) -> list[Path]:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    measured_axis = task != "math500"
    plotted = 0
    if paper and not measured_axis:
        scores = paper_results()["main_comparison"]["scores"]
        for name, key in MAIN_MODELS.items():
            mem = paper_memory(key)
            acc = scores.get(key, {}).get("math500", {}).get("accuracy")
            if mem is None or acc is None:
                continue
            colour = MELT_COLOUR if _is_melt(name) else OTHER_COLOUR
            ax.scatter(mem["total_gb_32k"], acc, s=70, facecolors="none", edgecolors=colour, linewidths=1.5)
            ax.annotate(f"{key} (paper)", (mem["total_gb_32k"], acc), textcoords="offset points", xytext=(5, 4), fontsize=7)
            plotted += 1
    for (model, t), result in sorted(rs.main.items()):
        if t != task:
            continue
        acc = _first_metric(result)
        if acc is None:
            continue
        if measured_axis:
            if not result.raw.get("peak_cache_bytes"):
                continue
            x = result.raw["peak_cache_bytes"] / MB
        else:
            if model not in MODELS or not MODELS[model].params:
                continue
            x = memory_row(model, contexts=(32_768,)).context(32_768).total_bytes / GB
        colour = MELT_COLOUR if _is_melt(model) else OTHER_COLOUR
        ax.scatter(x, acc, s=90 if _is_melt(model) else 60, color=colour, zorder=3)
        label = MODELS[model].display if model in MODELS else model
        ax.annotate(label, (x, acc), textcoords="offset points", xytext=(5, -10), fontsize=8,
                    fontweight="bold" if _is_melt(model) else "normal")
        plotted += 1
    ax.set_xlabel("measured KV cache of the run (MB)" if measured_axis else "total memory for a 32k-token generation (GB)")
    ax.set_ylabel(f"{task} accuracy / pass@1 (%)")
    ax.set_title("Memory vs accuracy" + ("" if measured_axis else " (hollow: paper, filled: reproduced)"))
    ax.grid(alpha=0.3)
    if not plotted:
        ax.text(0.5, 0.5, f"no {task} results yet", transform=ax.transAxes, ha="center")
    return _save(fig, out_dir / "memory_vs_accuracy")


def loops_figure(rs: ResultSet, out_dir: Path, task: str | None = None) -> list[Path]:
    """Accuracy and measured KV memory vs inference loops T, from every finished result with settings.loops."""
    plt = _pyplot()
    points: dict[str, dict[int, tuple[float | None, float | None]]] = defaultdict(dict)
    candidates = [r for r in rs.every if r.settings.get("loops")]
    if task is None:  # the task with the most loop settings
        counts = defaultdict(set)
        for r in candidates:
            counts[r.task].add(r.settings["loops"])
        task = max(counts, key=lambda t: len(counts[t]), default="math500")
    for r in candidates:
        if r.task != task:
            continue
        cache = r.raw.get("peak_cache_bytes")
        points[r.model][int(r.settings["loops"])] = (_first_metric(r), None if not cache else cache / MB)
    fig, (ax_acc, ax_mem) = plt.subplots(1, 2, figsize=(9, 3.6))
    for model, by_t in sorted(points.items()):
        ts = sorted(by_t)
        colour = MELT_COLOUR if _is_melt(model) else OTHER_COLOUR
        style = dict(marker="o", color=colour, linestyle="-" if _is_melt(model) else "--", label=model)
        ax_acc.plot(ts, [by_t[t][0] for t in ts], **style)
        ax_mem.plot(ts, [by_t[t][1] for t in ts], **style)
    ax_acc.set_xlabel("loops T at inference")
    ax_acc.set_ylabel(f"{task} accuracy / pass@1 (%)")
    ax_mem.set_xlabel("loops T at inference")
    ax_mem.set_ylabel("measured KV cache (MB)")
    for ax in (ax_acc, ax_mem):
        ax.grid(alpha=0.3)
    if points:
        ax_mem.legend(fontsize=7)
    else:
        ax_acc.text(0.5, 0.5, "no runs with --loops yet", transform=ax_acc.transAxes, ha="center")
    fig.tight_layout()
    return _save(fig, out_dir / "loops")


def _save(fig, stem: Path) -> list[Path]:
    stem.parent.mkdir(parents=True, exist_ok=True)
    paths = [stem.with_suffix(".png"), stem.with_suffix(".pdf")]
    for p in paths:
        fig.savefig(p, dpi=150, bbox_inches="tight")
    _pyplot().close(fig)
    return paths
