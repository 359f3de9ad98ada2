"""The paper's figure and the loops figure (matplotlib, Agg backend: no display needed).

memory_vs_accuracy: x = total memory for a 32k-token generation (model + KV cache, GB, bf16), y = MATH-500
accuracy. Paper points are hollow and sit at the paper's own "Total for 32k" figure; reproduced points
are filled and sit at our exact total for 32,768 tokens; a thin line joins a model's two points and the
model is labelled once. MELT is drawn in red. For a task outside the paper (the demo's `synthetic`)
there are no paper points and x is the KV cache the engine measured in the run (`peak_cache_bytes`).

loops: accuracy and KV memory against the number of loops T used at inference (`run --loops`).
Runs are grouped by checkpoint (results.json `model_path`, else `model`) and KV-sharing setting, so
`run --loops 2 --name melt-T2` and the T = 4 run of the same checkpoint make one line. The memory
panel is the bf16 KV cache of a 32,768-token generation at that T (from the registry or the
checkpoint's config.json: MELT flat, Ouro linear in T); a third panel shows the peak cache the runs
measured when they recorded one.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from melt_eval.protocol.labels import MAIN_MODELS
from melt_eval.registry import MODELS
from melt_eval.report.memory import GB, MB, kv_bytes_per_token_at, memory_row
from melt_eval.report.paper import paper_memory, paper_results
from melt_eval.report.results import ResultSet, compressed_cache, exit_points, split_fitted

MELT_COLOUR, OTHER_COLOUR = "#d62728", "#1f77b4"
TOKENS_32K = 32_768


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _is_melt(name: str) -> bool:
    return "melt" in name.lower()


def _display(model: str) -> str:
    return MODELS[model].display if model in MODELS else model


def _first_metric(result) -> float | None:
    for name in ("accuracy", "pass@1"):
        got = result.metric(name)
        if got is not None:
            return 100 * got[0]
    return None


# ------------------------------------------------------------------ memory vs accuracy


@dataclass
class Point:
    label: str
    x: float
    y: float
    source: str  # "paper" or "reproduced"
    melt: bool
    stderr: float | None = None  # percent: one standard error over the problems (reproduced points)


def memory_accuracy_points(rs: ResultSet, task: str = "math500", paper: bool = True) -> list[Point]:
    """What the figure draws: the paper's points (MATH-500 only) and one per reproduced model result."""
    points: list[Point] = []
    measured_axis = task != "math500"
    if paper and not measured_axis:
        scores = paper_results()["main_comparison"]["scores"]
        for name, key in MAIN_MODELS.items():
            mem = paper_memory(key)
            acc = scores.get(key, {}).get("math500", {}).get("accuracy")
            if mem is not None and acc is not None:
                points.append(Point(_display(name), mem["total_gb_32k"], acc, "paper", _is_melt(name)))
    for (model, t), result in sorted(rs.main.items()):
        acc = _first_metric(result) if t == task else None
        if acc is None:
            continue
        if measured_axis:
            if not result.raw.get("peak_cache_bytes"):
                continue
            x = result.raw["peak_cache_bytes"] / MB
        else:
            if model not in MODELS or not MODELS[model].params:
                continue  # no parameter count, no total memory
            x = memory_row(model, contexts=(TOKENS_32K,)).context(TOKENS_32K).total_bytes / GB
        metric = result.metric("accuracy") or result.metric("pass@1")
        se = None if metric is None or metric[1] is None else 100 * metric[1]
        points.append(Point(_display(model), x, acc, "reproduced", _is_melt(model), se))
    return points


def memory_vs_accuracy(rs: ResultSet, out_dir: Path, task: str = "math500", paper: bool = True) -> list[Path]:
    from matplotlib.lines import Line2D

    plt = _pyplot()
    points = memory_accuracy_points(rs, task, paper)
    fig, ax = plt.subplots(figsize=(6.8, 4.6))
    by_label: dict[str, dict[str, Point]] = defaultdict(dict)
    for p in points:
        by_label[p.label][p.source] = p
    for label, pair in by_label.items():
        melt = next(iter(pair.values())).melt
        colour = MELT_COLOUR if melt else OTHER_COLOUR
        if "paper" in pair and "reproduced" in pair:
            a, b = pair["paper"], pair["reproduced"]
            ax.plot([a.x, b.x], [a.y, b.y], color=colour, linewidth=0.8, alpha=0.5, zorder=1)
        if "paper" in pair:
            p = pair["paper"]
            ax.scatter(p.x, p.y, s=90 if melt else 60, facecolors="none", edgecolors=colour, linewidths=1.6, zorder=2)
        if "reproduced" in pair:
            p = pair["reproduced"]
            ax.scatter(p.x, p.y, s=110 if melt else 60, color=colour, marker="*" if melt else "o", zorder=3)
            if p.stderr:
                ax.errorbar(p.x, p.y, yerr=p.stderr, color=colour, elinewidth=1, capsize=3, zorder=2)
        anchor = pair.get("reproduced") or pair["paper"]  # one label per model
        ax.annotate(label, (anchor.x, anchor.y), textcoords="offset points", xytext=(7, -3), fontsize=8,
                    color=colour if melt else "black", fontweight="bold" if melt else "normal")
    measured_axis = task != "math500"
    ax.set_xlabel("KV cache measured in the run (MB)" if measured_axis
                  else "total memory for a 32k-token generation (GB, bf16)")
    ax.set_ylabel(("MATH-500" if task == "math500" else task) + " accuracy / pass@1 (%)")
    ax.set_title("Memory vs accuracy")
    ax.grid(alpha=0.3)
    if points:
        xmax = max(p.x for p in points)
        ax.set_xlim(left=0, right=xmax * 1.25)  # room for the labels right of the points
        handles = []
        if any(p.source == "paper" for p in points):
            handles.append(Line2D([], [], marker="o", linestyle="", markerfacecolor="none", markeredgecolor="grey",
                                  label="paper (its Total for 32k)"))
        if any(p.source == "reproduced" for p in points):
            handles.append(Line2D([], [], marker="o", linestyle="", color="grey",
                                  label="reproduced" + ("" if measured_axis else " (exact, 32,768 tokens)")
                                  + (", bars: one standard error" if any(p.stderr for p in points) else "")))
        handles.append(Line2D([], [], marker="o", linestyle="", color=MELT_COLOUR, label="MELT"))
        # the whole 0-100 scale: zoomed to the points, a gap inside one standard error looked like a cliff (issue 51)
        ax.set_ylim(0, 104)  # a little above 100: a point at 100 is not cut by the frame
        ax.set_yticks(range(0, 101, 20))
        # below the axes: inside it would cover labelled points
        ax.legend(handles=handles, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=len(handles),
                  frameon=False)
    else:
        ax.text(0.5, 0.5, f"no {task} results yet", transform=ax.transAxes, ha="center")
    return _save(fig, out_dir / "memory_vs_accuracy")


# ------------------------------------------------------------------ loops


@dataclass
class LoopPoint:
    loops: int
    accuracy: float | None  # percent
    kv_32k_gb: float | None  # analytic, bf16
    measured_mb: float | None  # the run's peak cache
    result: object = None  # the Result the point was read from (the claims pair its per-problem scores)


def _group_key(r) -> tuple:
    s = r.settings
    return (r.raw.get("model_path") or r.model, s.get("kv_sharing"), bool(s.get("share_prompt")))


def loops_task(rs: ResultSet) -> str | None:
    """The task with runs at the most distinct loop counts."""
    counts: dict[str, set] = defaultdict(set)
    for r in rs.every:
        if r.settings.get("loops"):
            counts[r.task].add(int(r.settings["loops"]))
    return max(counts, key=lambda t: (len(counts[t]), t == "math500"), default=None)


def loops_points(rs: ResultSet, task: str | None = None) -> dict[str, list[LoopPoint]]:
    """Per model (one line each), its points by T; only models run at two or more loop counts."""
    task = task or loops_task(rs)
    groups: dict[tuple, dict] = defaultdict(dict)
    for r in rs.every:
        # all loops, the model's own cache only: an exit or a compressed cache is another figure's point
        if r.settings.get("loops") and r.task == task and not r.settings.get("exit") and not compressed_cache(r):
            groups[_group_key(r)][int(r.settings["loops"])] = r
    out = {}
    for key, by_t in groups.items():
        if len(by_t) < 2:
            continue
        names = {r.model for r in by_t.values()}
        label = min(names, key=len)  # "melt-1.6b" over "melt-1.6b-T2"
        # A registry name anywhere in the group describes the checkpoint for all its runs.
        arch = next((n for n in sorted(names) if n in MODELS), None)
        line = []
        for t in sorted(by_t):
            r = by_t[t]
            kv = kv_bytes_per_token_at(arch or r.model, r.raw.get("model_path"), t, r.settings.get("kv_sharing"))
            cache = r.raw.get("peak_cache_bytes")
            line.append(LoopPoint(t, _first_metric(r), None if kv is None else kv * TOKENS_32K / GB,
                                  cache / MB if cache else None, r))
        if key[1]:
            label += f" (kv-sharing {key[1]})"
        out[label] = line
    return dict(sorted(out.items()))


def loops_figure(rs: ResultSet, out_dir: Path, task: str | None = None) -> list[Path]:
    plt = _pyplot()
    task = task or loops_task(rs) or "math500"
    points = loops_points(rs, task)
    measured = any(p.measured_mb for ps in points.values() for p in ps)
    fig, axes = plt.subplots(1, 3 if measured else 2, figsize=(13 if measured else 9, 3.8))
    ax_acc, ax_kv = axes[0], axes[1]
    for label, ps in points.items():
        colour = MELT_COLOUR if _is_melt(label) else OTHER_COLOUR
        style = dict(marker="o", color=colour, linestyle="-" if _is_melt(label) else "--", label=_display(label))
        ts = [p.loops for p in ps]
        ax_acc.plot(ts, [p.accuracy for p in ps], **style)
        ax_kv.plot(ts, [p.kv_32k_gb for p in ps], **style)
        if measured:
            axes[2].plot(ts, [p.measured_mb for p in ps], **style)
    ax_acc.set_ylabel(("MATH-500" if task == "math500" else task) + " accuracy / pass@1 (%)")
    ax_kv.set_ylabel("KV cache for 32,768 tokens (GB, bf16)")
    ax_kv.set_ylim(bottom=0)
    if measured:
        axes[2].set_ylabel("peak KV cache measured in the run (MB)")
        axes[2].set_ylim(bottom=0)
    for ax in axes:
        ax.set_xlabel("loops T at inference")
        ax.grid(alpha=0.3)
        ax.xaxis.get_major_locator().set_params(integer=True)
    if points:
        ax_kv.legend(fontsize=7)
    else:
        ax_acc.text(0.5, 0.5, "no model run at several loop counts yet\n(melt-eval run --loops T)",
                    transform=ax_acc.transAxes, ha="center", fontsize=8)
    fig.suptitle("Accuracy and KV memory vs loops at inference", fontsize=10)
    fig.tight_layout()
    return _save(fig, out_dir / "loops")


def exit_figure(rs: ResultSet, out_dir: Path) -> list[Path]:
    """Beyond the paper: accuracy against mean loops per generated token under --exit, one line per checkpoint
    and task, its full-depth run a star (`melt-eval ablate exit`). Nothing is drawn without --exit runs."""
    points = exit_points(rs)
    if not points:
        return []
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for (label, task), ps in points.items():
        model, fitted = split_fitted(label)  # a fitted gate: its own series, dotted with squares
        colour = MELT_COLOUR if _is_melt(model) else OTHER_COLOUR
        ps = [p for p in ps if _first_metric(p.result) is not None]
        ax.plot([p.mean_loops for p in ps], [_first_metric(p.result) for p in ps], marker="s" if fitted else "o",
                color=colour, linestyle=":" if fitted else "-" if _is_melt(model) else "--",
                label=f"{_display(model)}{fitted} ({task})")
        for p in ps:
            if p.rule is None:
                ax.plot([p.mean_loops], [_first_metric(p.result)], marker="*", markersize=14, color=colour)
            else:
                ax.annotate(p.rule, (p.mean_loops, _first_metric(p.result)), fontsize=6, xytext=(3, 3),
                            textcoords="offset points")
    ax.set_xlabel("mean loops per generated token")
    ax.set_ylabel("accuracy / pass@1 (%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.suptitle("Early exit (beyond the paper): accuracy against loops spent; star = all loops", fontsize=9)
    fig.tight_layout()
    return _save(fig, out_dir / "exit")


def _save(fig, stem: Path) -> list[Path]:
    stem.parent.mkdir(parents=True, exist_ok=True)
    paths = [stem.with_suffix(".png"), stem.with_suffix(".pdf")]
    for p in paths:
        fig.savefig(p, dpi=150, bbox_inches="tight")
    _pyplot().close(fig)
    return paths


# ------------------------------------------------------------------ the memory frontier (beyond the paper)

# Each evaluated row's family, in legend order, with its colour and marker.
FAMILIES = {
    "teacher (Ouro)": ("#1f77b4", "o"), "MELT": (MELT_COLOUR, "*"), "gates": ("#ff7f0e", "s"),
    "ladder": ("#8c564b", "v"), "untrained sharing": ("#7f7f7f", "x"), "quantized cache": ("#2ca02c", "D"),
    "cross-loop (training-free)": ("#9467bd", "P"), "GQA-MELT": ("#e377c2", "h"), "other": ("#17becf", "."),
}


@dataclass
class FrontierPoint:
    label: str
    family: str
    bytes_per_sequence: float
    score: float  # percent
    stderr: float | None  # percent


def bytes_per_sequence(r) -> float | None:
    """The KV cache the native engine measured for one sequence: its peak (one wave of rows, each allocated for the
    batch's longest prompt + max_new_tokens) over that wave's rows (`cache_rows`). Results written before
    `cache_rows` existed: the native backend's batch, min(problems, 64 // samples) problems x samples rows."""
    peak = r.raw.get("peak_cache_bytes")
    if not peak:
        return None
    rows = r.raw.get("cache_rows")
    if not rows:
        samples = r.settings.get("samples") or 1
        rows = min(r.raw.get("num_problems") or 1, max(1, 64 // samples)) * samples
    return peak / rows


def _family(where: tuple[str, str] | None, r) -> str:
    s, name = r.settings, " ".join(str(x) for x in (where or ()) + (r.model,)).lower()
    if s.get("cross_loop_kv"):
        return "cross-loop (training-free)"
    if s.get("kv_cache_dtype", "auto") != "auto":
        return "quantized cache"
    if s.get("kv_sharing"):
        return "untrained sharing"
    if "gqa" in name:
        return "GQA-MELT"
    if where is None:
        return "MELT" if _is_melt(r.model) else "teacher (Ouro)"
    ablation, variant = where
    if ablation == "gates":
        return "gates"
    if ablation == "components":
        return "MELT" if variant == "full" else "ladder"
    if ablation in ("kv-sharing", "kv-compression"):
        return "MELT" if _is_melt(variant) else "teacher (Ouro)"
    return "other"


def frontier_points(rs: ResultSet, task: str) -> list[FrontierPoint]:
    """Every evaluated row of `task` with a measured cache, once: a row evaluated twice (the demo's ouro-tiny is
    also the untrained-sharing table's `ouro`) is drawn once, under its main-table name if it has one."""
    seen, points = set(), []
    rows = [(None, r) for (_, t), r in sorted(rs.main.items()) if t == task]
    rows += [((a, v), r) for (a, v, t), r in sorted(rs.ablations.items()) if t == task]
    for where, r in rows:
        s = r.settings
        key = (r.raw.get("model_path") or r.model, s.get("loops"), s.get("kv_sharing"), bool(s.get("share_prompt")),
               s.get("kv_cache_dtype", "auto"), bool(s.get("cross_loop_kv")))
        per_seq, got = bytes_per_sequence(r), _first_metric(r)
        if key in seen or per_seq is None or got is None or s.get("exit"):  # early exit has its own figure
            continue
        seen.add(key)
        metric = r.metric("accuracy") or r.metric("pass@1")
        se = None if metric is None or metric[1] is None else 100 * metric[1]
        # the compressed rows' names say what they are ("melt-int4"); the others' say their table
        label = _display(r.model) if where is None else where[1] if where[0] == "kv-compression" else f"{where[0]}: {where[1]}"
        points.append(FrontierPoint(label, _family(where, r), per_seq, got, se))
    return points


def pareto(points: list[FrontierPoint]) -> list[FrontierPoint]:
    """The points no other point beats on both axes (fewer bytes and a higher score), by bytes."""
    front, best = [], float("-inf")
    for p in sorted(points, key=lambda p: (p.bytes_per_sequence, -p.score)):
        if p.score > best:
            front.append(p)
            best = p.score
    return front


def memory_frontier(rs: ResultSet, out_dir: Path, task: str) -> list[Path]:
    """Every evaluated row at its measured cache bytes per sequence, error bars one standard error, the Pareto
    frontier joined, one legend entry per family."""
    from adjustText import adjust_text

    plt = _pyplot()
    points = frontier_points(rs, task)
    fig, ax = plt.subplots(figsize=(7.6, 4.8))
    labels = []
    for family, (colour, marker) in FAMILIES.items():
        ps = [p for p in points if p.family == family]
        if not ps:
            continue
        ax.errorbar([p.bytes_per_sequence / MB for p in ps], [p.score for p in ps],
                    yerr=[p.stderr or 0 for p in ps], fmt=marker, color=colour, ecolor=colour, elinewidth=0.8,
                    capsize=2, markersize=9 if marker == "*" else 6, label=family, zorder=3)
    # A keyed legend: a number beside each point, the rows it stands for in the key right of the axes. Many rows
    # share a cache size and nearly a score (MELT and its gates, the ladder), where names overlapped; rows at the
    # same point share a number.
    at: dict[tuple, list[FrontierPoint]] = defaultdict(list)
    for p in points:
        at[(round(p.bytes_per_sequence / MB, 3), round(p.score, 1))].append(p)
    key = []
    for i, ((x, y), ps) in enumerate(sorted(at.items(), key=lambda item: (-item[0][1], item[0][0])), 1):
        labels.append(ax.text(x, y, str(i), fontsize=7, fontweight="bold", color=FAMILIES[ps[0].family][0], zorder=5))
        key.append(f"{i:>2} {y:5.1f}  " + " / ".join(p.label for p in ps))
    front = pareto(points)
    if len(front) > 1:
        ax.plot([p.bytes_per_sequence / MB for p in front], [p.score for p in front], color="black", linewidth=1,
                alpha=0.6, zorder=2, label="Pareto frontier")
    ax.set_xlabel("KV cache per sequence, measured in the run (MB)")
    ax.set_ylabel(f"{task} accuracy / pass@1 (%)")
    ax.set_title("Memory frontier: every evaluated row")
    ax.grid(alpha=0.3)
    if points:
        lo = min(p.score - (p.stderr or 0) for p in points)
        hi = max(p.score + (p.stderr or 0) for p in points)
        pad = max(2.0, 0.08 * (hi - lo))
        top = min(100.0, hi + pad)
        ax.set_ylim(max(0.0, lo - pad), top + 5)  # 5 points above the top row: room for its numbers
        ax.set_yticks([t for t in ax.get_yticks() if t <= 100])
        ax.set_xlim(left=0, right=max(p.bytes_per_sequence for p in points) / MB * 1.2)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=4, frameon=False)
        ax.text(1.02, 1.0, "    pass@1  rows\n" + "\n".join(key), transform=ax.transAxes, va="top", fontsize=6.5,
                family="monospace")
        # the numbers moved apart and off the markers (adjustText), each joined to its point by a thin line
        adjust_text(labels, x=[x for x, _ in at], y=[y for _, y in at], ax=ax, expand=(1.4, 1.8),
                    arrowprops=dict(arrowstyle="-", color="grey", lw=0.4))
    else:
        ax.set_ylim(0, 100)
        ax.text(0.5, 0.5, f"no {task} results with a measured cache yet", transform=ax.transAxes, ha="center")
    return _save(fig, out_dir / "memory_frontier")
