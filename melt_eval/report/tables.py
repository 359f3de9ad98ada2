"""The paper's five tables, built from a results directory (or from the paper's numbers when there are none).

A `Table` holds numbers, not strings: emphasis (bold best, underlined second) is decided on the values
as printed, so ties that print alike are marked alike, as in the paper. `melt_eval.report.render` turns a
`Table` into Markdown, booktabs LaTeX or a rich table.
"""

from __future__ import annotations

from melt_eval.protocol.labels import BENCHMARK_LABELS, MAIN_MODELS
from melt_eval.protocol.tasks import ABLATION_BENCHMARKS, MATH_BENCHMARKS, NON_MATH_BENCHMARKS
from melt_eval.registry import MODELS
from melt_eval.report.mistakes import mistakes_table
from melt_eval.report.memory import GB, MB, memory_table, paper_notes
from melt_eval.report.paper import ABLATION_FALLBACKS, ABLATIONS, benchmark_metrics, paper_results
from melt_eval.report.render import NA, Cell, Row, Table
from melt_eval.report.results import ResultSet

# ------------------------------------------------------------------ emphasis


def mark(cells: list[Cell], second: bool) -> None:
    """Bold every cell equal to the best printed value; with `second`, underline the next distinct value."""
    values = sorted({c.rounded() for c in cells if c.rounded() is not None}, reverse=True)
    for c in cells:
        c.bold = c.underline = False
        if c.rounded() is None or not values:
            continue
        c.bold = c.rounded() == values[0]
        c.underline = second and len(values) > 1 and c.rounded() == values[1]


# ------------------------------------------------------------------ builders


def _display(model: str) -> str:
    spec = MODELS.get(model)
    return spec.display if spec else model


def _pct(res, metric: str) -> tuple[float | None, float | None]:
    got = res.metric(metric) if res is not None else None
    if got is None:
        return None, None
    value, stderr = got
    return 100 * value, None if stderr is None else 100 * stderr


def main_table(rs: ResultSet, compare: bool = False) -> Table:
    paper = paper_results()["main_comparison"]
    from_paper = rs.empty
    models = list(MAIN_MODELS)
    notes: list[str] = []
    if not from_paper:
        sweeps = rs.loop_sweep_dirs()
        models += [m for m in rs.main_models() if m not in MAIN_MODELS and m not in sweeps]
        if sweeps:
            notes.append(f"Runs at other loop counts ({', '.join(sorted(sweeps))}) are in the loops figure, not here.")
    compare = compare and not from_paper

    def paper_score(model, bench, metric):
        key = MAIN_MODELS.get(model)
        return paper["scores"].get(key, {}).get(bench, {}).get(metric) if key else None

    def paper_stderr(model, bench, metric):
        key = MAIN_MODELS.get(model)
        errs = paper["stderr"].get(key, {}).get(bench) if key else None
        return errs[benchmark_metrics(bench).index(metric)] if errs else None

    rows: list[Row] = []
    firsts: dict[str, dict[str, float | None]] = {m: {} for m in models}  # unrounded pass@1/accuracy, for averages

    def average_row(label: str, benches, which: str) -> Row:
        cells = []
        for m in models:
            vals = [firsts[m].get(b) for b in benches]
            computed = sum(vals) / len(vals) if all(v is not None for v in vals) else None
            printed = paper["averages_pass@1"].get(MAIN_MODELS.get(m, ""), {}).get(which)
            if from_paper:
                # The paper's own table prints its own averages; say where they disagree with its cells.
                if printed is not None and computed is not None and round(computed, 1) != printed:
                    notes.append(
                        f"The paper prints {printed:.1f} as {_display(m)}'s {label.lower()}; "
                        f"its own cells average to {computed:.1f}."
                    )
                cells.append(Cell(printed))
            else:
                cells.append(Cell(computed, paper=printed if compare else None))
        mark(cells, second=True)
        return Row([label, "pass@1"], cells, shaded=True)

    for bench, label in BENCHMARK_LABELS.items():
        for i, metric in enumerate(benchmark_metrics(bench)):
            cells = []
            for m in models:
                if from_paper:
                    value, stderr = paper_score(m, bench, metric), paper_stderr(m, bench, metric)
                else:
                    value, stderr = _pct(rs.main.get((m, bench)), metric)
                if i == 0:
                    firsts[m][bench] = value
                cells.append(Cell(value, stderr, paper=paper_score(m, bench, metric) if compare else None))
            mark(cells, second=True)
            rows.append(Row([label if i == 0 else "", metric], cells, rule_before=bench == NON_MATH_BENCHMARKS[0] and i == 0))
        if bench == MATH_BENCHMARKS[-1]:
            rows.append(average_row("Avg math", MATH_BENCHMARKS, "math"))
    rows.append(average_row("Avg non-math", NON_MATH_BENCHMARKS, "non_math"))

    if not from_paper:
        notes.append("Averages are over pass@1 (accuracy for one-sample tasks); n/a unless every benchmark has a result.")
    return Table(
        key="main",
        title="Main comparison",
        caption="Performance comparison across benchmarks (mean $\\pm$ standard error, percent). "
        "\\textbf{Bold}: best; \\underline{underlined}: second best.",
        stub_heads=["Dataset", "Metric"],
        heads=[_display(m) for m in models],
        rows=rows,
        notes=notes,
        compare=compare,
        source="paper" if from_paper else "results",
    )


def ablation_table(rs: ResultSet, ablation: str, compare: bool = False) -> Table:
    info = ABLATIONS[ablation]
    section = paper_results()[info["section"]]
    from_paper = rs.empty
    compare = compare and not from_paper
    variants = list(info["variants"])
    if not from_paper:
        variants += [v for v in rs.ablation_variants(ablation) if v not in info["variants"]]
    columns = _ablation_columns(rs, ablation, from_paper)
    notes: list[str] = []

    def result_for(variant, bench):
        got = rs.ablations.get((ablation, variant, bench))
        if got is not None:
            return got
        where = ABLATION_FALLBACKS.get((ablation, variant))
        if where is None:
            return None
        got = rs.main.get((where[1], bench)) if where[0] == "main" else rs.ablations.get((where[0], where[1], bench))
        if got is not None:
            src = f"results/{where[1]}" if where[0] == "main" else f"results/ablations/{where[0]}/{where[1]}"
            note = f"{info['variants'][variant][1]}: no results of its own; the same run's results from {src} are shown."
            if note not in notes:
                notes.append(note)
        return got

    names = {} if from_paper else producers(rs)
    base = names.get("ouro" if ablation == "kv-sharing" else "melt")
    rows = []
    for v in variants:
        paper_key, label = info["variants"].get(v, (None, v))
        stub = [label.replace("- ", "\u2212 ", 1)]
        if base:  # name the model that produced the numbers; the paper's row beside
            stub = [_our_label(ablation, v, label, _display(base)), stub[0]]
        cells = []
        for bench, metric in columns:
            printed = section.get(paper_key, {}).get(bench, {}).get(metric) if paper_key and bench in ABLATION_BENCHMARKS else None
            if from_paper:
                cells.append(Cell(printed))
            else:
                value, _ = _pct(result_for(v, bench), metric)
                cells.append(Cell(value, paper=printed if compare else None))
        rows.append(Row(stub, cells))
    for j in range(len(columns)):  # the ablation tables bold the best of each column only
        mark([r.cells[j] for r in rows], second=False)
    if not from_paper and not any(k[0] == ablation for k in rs.ablations):
        notes.append(f"No results under {rs.root}/ablations/{ablation}; run `melt-eval ablate {ablation}`.")
    title = info["title"].replace("Ouro-1.4B-Thinking", _display(base)) if base else info["title"]
    return Table(
        key=ablation,
        title=title,
        caption=f"{title} (percent). \\textbf{{Bold}}: best in each column.",
        stub_heads=["Model" if base else info["stub"]] + (["Paper's row"] if base else []),
        heads=[m for _, m in columns],
        groups=_groups(columns),
        rows=rows,
        notes=notes,
        compare=compare,
        source="paper" if from_paper else "results",
    )


def producers(rs: ResultSet) -> dict[str, str]:
    """The main-table names of the checkpoints behind the ablations (same model_path): "melt" (the full
    MELT row) and "ouro" (the untrained-sharing base), e.g. the demo's melt-tiny and ouro-tiny."""
    from melt_eval.report.claims import producer_name

    found = {"melt": producer_name(rs, "components", "full"), "ouro": producer_name(rs, "kv-sharing", "ouro")}
    return {k: v for k, v in found.items() if v}


def _our_label(ablation: str, variant: str, paper_label: str, base: str) -> str:
    """An ablation row named by the model that produced it (e.g. "melt-tiny (P1), mean")."""
    if variant in ("full", "ouro"):
        return base
    if ablation == "gates":
        return f"{base} (P1, elementwise)" if variant == "elementwise" else f"{base} (P1), {paper_label.lower()}"
    if ablation == "components":
        return f"{base} {paper_label.replace('- ', chr(0x2212) + ' ', 1)}"
    return f"{base}, {paper_label[0].lower()}{paper_label[1:]}"


def _task_metrics(rs: ResultSet, task: str) -> list[str]:
    """Metrics of a task outside the paper, as its results name them (pass@1 first)."""
    names = {m for r in rs.every if r.task == task for m in r.metrics}
    return sorted(names, key=lambda m: (not m.startswith("pass@"), int(m[5:]) if m[5:].isdigit() else 0, m))


def _ablation_columns(rs: ResultSet, ablation: str, from_paper: bool) -> list[tuple[str, str]]:
    """The paper's four benchmarks (unless only other tasks have results), then any other task run."""
    tasks = [t for a, _, t in rs.ablations if a == ablation]
    extra = list(dict.fromkeys(t for t in tasks if t not in ABLATION_BENCHMARKS))
    paper_cols = from_paper or not extra or any(t in ABLATION_BENCHMARKS for t in tasks)
    cols = [(b, m) for b in ABLATION_BENCHMARKS for m in benchmark_metrics(b)] if paper_cols else []
    return cols + [(t, m) for t in extra for m in _task_metrics(rs, t)]


def _groups(columns: list[tuple[str, str]]) -> list[tuple[str, int]]:
    groups: list[tuple[str, int]] = []
    for bench, _ in columns:
        label = BENCHMARK_LABELS.get(bench, bench)
        if groups and groups[-1][0] == label:
            groups[-1] = (label, groups[-1][1] + 1)
        else:
            groups.append((label, 1))
    return groups


def exit_table(rs: ResultSet) -> Table:
    """Beyond the paper: each checkpoint's accuracy and mean loops per generated token under every --exit rule it
    was run with, full depth first (`melt-eval ablate exit`; the figure is plots/exit.png)."""
    from melt_eval.report.results import exit_points, split_fitted

    rows = []
    for (label, task), points in exit_points(rs).items():
        full = [p for p in points if p.rule is None]
        for i, p in enumerate(full + [p for p in points if p.rule is not None]):
            value, stderr = _pct(p.result, "accuracy")  # pass@1 where the task samples several
            model, fitted = split_fitted(label)  # the inherited (or own) gate and the fitted one: separate rows
            rows.append(Row([_display(model) + fitted, task, p.rule or "all loops"],
                            [Cell(p.mean_loops, digits=2), Cell(value, stderr)], rule_before=i == 0 and bool(rows)))
    return Table(
        key="exit",
        title="Beyond the paper: early exit",
        caption="Early exit of generated tokens (\\texttt{--exit}; the prompt keeps full depth): mean loops per "
        "generated token and accuracy / pass@1 (mean $\\pm$ standard error, percent); ``fitted gate'': the gate "
        "the exit-gate recipe fitted to the model's own loop states (Ouro's stage II). Not in the paper, which "
        "leaves adaptive depth to future work.",
        stub_heads=["Model", "Task", "Exit rule"],
        heads=["Loops / token", "Accuracy / pass@1"],
        rows=rows,
    )


def other_tasks_table(rs: ResultSet) -> Table | None:
    """Models x metrics for tasks outside the paper's benchmarks (e.g. the demo's synthetic task)."""
    extra = list(dict.fromkeys(t for _, t in rs.main if t not in BENCHMARK_LABELS))
    if not extra:
        return None
    columns = [(t, m) for t in extra for m in _task_metrics(rs, t)]
    # the paper's model each one stands in for (the demo's melt-tiny for MELT-1.6B, ...)
    stands_for = {name: MAIN_MODELS[{"melt": "melt-1.6b", "ouro": "ouro-1.4b-thinking"}[kind]]
                  for kind, name in producers(rs).items()}
    rows = []
    for model in [m for m in rs.main_models() if m not in rs.loop_sweep_dirs()]:
        cells = []
        for task, metric in columns:
            value, stderr = _pct(rs.main.get((model, task)), metric)
            cells.append(Cell(value, stderr))
        rows.append(Row([_display(model)] + ([stands_for.get(model, "")] if stands_for else []), cells))
    for j in range(len(columns)):
        mark([r.cells[j] for r in rows], second=True)
    return Table(
        key="other",
        title="Other tasks",
        caption="Tasks outside the paper's benchmarks (mean $\\pm$ standard error, percent). "
        "\\textbf{Bold}: best; \\underline{underlined}: second best.",
        stub_heads=["Model"] + (["Paper's model"] if stands_for else []),
        heads=[m for _, m in columns],
        groups=_groups(columns),
        rows=rows,
    )


MEMORY_TOKENS = 32_768  # the paper's text defines "32k" as 32,768 tokens
# The paper's memory rows in its order; the last three are commented out of its printed table.
MEMORY_MODELS = ["melt-1.6b", "ouro-1.4b-thinking", "qwen3-1.7b", "deepseek-r1-1.5b", "qwen3.5-2b", "gemma4-e2b"]


def memory_report_table(rs: ResultSet, compare: bool = False) -> Table:
    """Memory: the paper's rows; ours are exact for 32,768 tokens, the paper's as printed."""
    from_paper = rs.empty
    compare = compare and not from_paper
    rows_m = [r for r in memory_table(MEMORY_MODELS, contexts=(MEMORY_TOKENS,)) if r.paper is not None]
    digits = [6, 3, 2, 2]

    def ours(r):
        c = r.context(MEMORY_TOKENS)
        return [r.kv_bytes_per_token / MB, None if r.model_bytes is None else r.model_bytes / GB, c.kv_bytes / GB,
                None if c.total_bytes is None else c.total_bytes / GB]

    def theirs(r):
        p = r.paper
        return [p.kv_mb_per_token, p.model_gb, p.kv_gb_32k, p.total_gb_32k]

    rows: list[Row] = []
    for r in rows_m:
        vals = theirs(r) if from_paper else ours(r)
        cells = [Cell(v, digits=d, paper=p if compare else None) for v, d, p in zip(vals, digits, theirs(r))]
        label = r.display + (" \u2020" if r.paper.commented_out else "")
        if not from_paper and r.kv_source != "analytic":
            label += "*"
        # Rules as in the paper: after the looped pair (and its improvement row), before the commented-out rows.
        after_pair = bool(rows) and rows[-1].stub[0] == "Memory improvement"
        first_hidden = r.paper.commented_out and not any(x.paper.commented_out for x in rows_m[: rows_m.index(r)])
        rows.append(Row([label], cells, rule_before=after_pair or first_hidden))
        if r.model == "ouro-1.4b-thinking":
            melt = next((x for x in rows_m if x.model == "melt-1.6b"), None)
            if melt is not None:
                mv = theirs(melt) if from_paper else ours(melt)
                # Model memory is not an improvement (MELT adds parameters): the paper prints "--" there.
                ratios = [None if (a is None or b is None or i == 1) else a / b for i, (a, b) in enumerate(zip(vals, mv))]
                rows.append(Row(["Memory improvement"], [Cell(text="--" if x is None else "\u00d7" + _ratio(x)) for x in ratios]))
    notes = paper_notes(rows_m)
    if from_paper:  # the vLLM-reading marker describes our figures, not the paper's
        notes = [n for n in notes if not n.startswith("Per-token KV marked")]
    else:
        notes.insert(0, f"Ours: bf16, exact arithmetic from the architecture, 32k = {MEMORY_TOKENS:,} tokens.")
    return Table(
        key="memory",
        title="Memory",
        caption="KV-cache memory per token and VRAM for a 32k-token generation (MB $=10^6$, GB $=10^9$ bytes).",
        stub_heads=["Model"],
        heads=["KV-cache (MB/token)", "Model memory (GB)", "KV-cache for 32k (GB)", "Total for 32k (GB)"],
        rows=rows,
        notes=notes,
        compare=compare,
        source="paper" if from_paper else "results",
    )


def _ratio(x: float) -> str:
    return f"{x:.2f}".rstrip("0").rstrip(".")


_MARKS = {True: "\u2713", False: "\u2717", None: NA}


def claims_table(rs: ResultSet) -> Table:
    """The paper's claims, each with what the results measured, its threshold and whether it holds;
    the same check on the paper's own numbers beside (melt_eval.report.claims)."""
    from melt_eval.report.claims import paper_claims

    rows = [Row([c.claim], [Cell(text=c.measured or "not run"), Cell(text=c.threshold), Cell(text=_MARKS[c.holds]),
                            Cell(text=c.paper or "(a figure; no numbers)"), Cell(text=_MARKS[c.paper_holds])])
            for c in paper_claims(rs)]
    return Table(
        key="claims",
        title="Paper claims",
        caption="The paper's claims checked against these results (pass@1, or accuracy for one-sample tasks, "
        "averaged over the tasks the compared models share), and the same check on the paper's own numbers "
        "(averaged over its benchmarks).",
        stub_heads=["Claim"],
        heads=["Measured", "Threshold", "Holds", "Paper's numbers", "Holds in the paper"],
        rows=rows,
        notes=["n/a: the results a claim needs are missing."],
    )


def claims_across_table(runs) -> Table:
    """The claims in each of several runs (`claims.RunClaims`, e.g. the demo at several seeds): the verdict
    and its deciding figures per run, how many runs each holds in, and the check on the paper's numbers."""
    from melt_eval.report.claims import NOISE, gate_head_to_head

    first = runs[0].claims
    rows = []
    for i, c in enumerate(first):
        per_run = [r.claims[i] for r in runs]
        measured = sum(x.holds is not None for x in per_run)
        cells = [Cell(text=f"{_MARKS[x.holds]} {x.brief or x.measured or 'not run'}") for x in per_run]
        close = sum(x.close_call is True for x in per_run)
        cells.append(Cell(text=f"{sum(x.holds is True for x in per_run)} of {measured}" + (f" ({close} close)" if close else "")
                          if measured else NA))
        cells.append(Cell(text=f"{_MARKS[c.paper_holds]} {c.paper}" if c.paper else "(a figure; no numbers)"))
        rows.append(Row([c.claim], cells))
    rows.append(Row(["Claims that hold"], [Cell(text=f"{r.holding} of {len(r.claims)}") for r in runs] + [Cell(text=""), Cell(text="")],
                    rule_before=True))
    rows.append(Row(["Close calls"], [Cell(text=str(r.close_calls)) for r in runs] + [Cell(text=""), Cell(text="")]))
    pairs = gate_head_to_head(runs)
    return Table(
        key="claims-across",
        title=f"Paper claims across {len(runs)} runs",
        caption="The paper's claims checked in each run (pass@1; the thresholds of the claims table), how many "
        "runs each holds in, and the same check on the paper's own numbers.",
        stub_heads=["Claim"],
        heads=[r.label for r in runs] + ["Holds in", "The paper"],
        rows=rows,
        notes=["Ladder: full MELT, then each component removed in turn (- align, - interp, - KD); > where the "
               "removal lowers pass@1. Gate: element-wise, then the best other gate; se: the lead in standard "
               "errors of the difference (paired over the problems where both evaluations kept them). "
               "Loops: pass@1 at T = 1, 2, .... In brackets after the ladder and the loops: the step nearest the "
               f"noise, where one is under {NOISE:g} standard errors (the ladder's as what the removal changes).",
               f"Close: the verdict rests on a gap under {NOISE:g} standard errors (a ✓ with such a step, a ✗ whose "
               "every failing step is one), so a rerun at another seed or on another machine's floats could turn it.",
               "n/a: the results a claim needs are missing."]
        + ([f"Read as saved in their claims.json, not computed from results: {', '.join(r.label for r in runs if r.saved)}."]
           if any(r.saved for r in runs) else [])
        + (["Element-wise against each gate alone, runs where it scores at least as high, and the mean of "
            "element-wise minus that gate over the runs (points, ± its standard error over the runs): "
            + ", ".join(f"{g} {h.at_least_as_high} of {h.runs} ({100 * h.mean_gap + 0.0:+.1f}"
                        + ("" if h.gap_stderr is None else f" ± {100 * h.gap_stderr:.1f}") + ")"
                        for g, h in pairs.items()) + "."] if pairs else []),
    )


def has_paper_benchmarks(rs: ResultSet) -> bool:
    return any(t in BENCHMARK_LABELS for _, t in rs.main)


def build_tables(rs: ResultSet, compare: bool = False) -> list[Table]:
    """Every table. With results: the claims table first; the main table only when some result is on one of
    the paper's benchmarks (a demo's models would fill it with n/a)."""
    tables = [
        ablation_table(rs, "gates", compare),
        ablation_table(rs, "components", compare),
        ablation_table(rs, "kv-sharing", compare),
        memory_report_table(rs, compare),
    ]
    if rs.empty or has_paper_benchmarks(rs):
        tables.insert(0, main_table(rs, compare))
    if not rs.empty:
        tables.insert(0, claims_table(rs))
    other = other_tasks_table(rs)
    mistakes = None if rs.empty else mistakes_table(rs)
    from melt_eval.report.results import exit_points

    compressed = None if rs.empty else beyond_paper_table(rs)  # beside the paper's tables
    exits = exit_table(rs) if exit_points(rs) else None  # after the paper's tables: not one of them
    return tables + [t for t in (compressed, other, mistakes, exits) if t is not None]


def beyond_paper_table(rs: ResultSet) -> Table | None:
    """`ablate kv-compression`'s rows (docs/method.md#quantized-caches): each compressed cache beside its uncompressed
    model, with the cache the run measured per sequence and the gap in paired standard errors. None without them."""
    from melt_eval.protocol.variants import KV_COMPRESSION
    from melt_eval.report.claims import _paired_stderr, problem_scores
    from melt_eval.report.plots import bytes_per_sequence

    tasks = sorted({t for a, _, t in rs.ablations if a == "kv-compression"})
    if not tasks:
        return None

    def result(variant, task):
        got = rs.ablations.get(("kv-compression", variant.name, task))
        # the uncompressed rows are the other tables' runs; a compressed row not run borrows nothing (MELT's rows
        # name the full run as theirs for its training, not for its scores)
        if got is None and variant.fallback and variant.name in ("ouro", "melt"):
            got = rs.ablations.get((*variant.fallback, task))
        return got

    rows, teacher_bytes, notes = [], {}, []
    for task in tasks:
        base = {v.name: result(v, task) for v in KV_COMPRESSION.variants if v.name in ("ouro", "melt")}
        if base["ouro"] is not None:
            teacher_bytes[task] = bytes_per_sequence(base["ouro"])
        first = True
        for v in KV_COMPRESSION.variants:
            r = result(v, task)
            if r is None and v.name not in base:  # a row not run (the demo runs a few): no line of n/a
                continue
            value, se = _pct(r, "pass@1") if r is not None and "pass@1" in r.metrics else _pct(r, "accuracy")
            per_seq = bytes_per_sequence(r) if r is not None else None
            analytic = r.raw.get("analytic_cache_bytes") if r is not None else None
            rows_in_wave = r.raw.get("cache_rows") if r is not None else None
            ref = base["melt" if v.name.startswith("melt") else "ouro"]
            gap = Cell(text="")
            if r is not None and ref is not None and r is not ref and value is not None:
                ref_value, _ = _pct(ref, "pass@1") if "pass@1" in ref.metrics else _pct(ref, "accuracy")
                paired = _paired_stderr({task: problem_scores(r)}, {task: problem_scores(ref)})
                diff = value - ref_value
                gap = Cell(text=f"{diff:+.1f}" + ("" if not paired else f" ({diff / (100 * paired):+.1f} se)"))
            ratio = (per_seq / teacher_bytes[task]) if per_seq and teacher_bytes.get(task) else None
            rows.append(Row([task, v.paper_label], [
                Cell(value, stderr=se), Cell(None if per_seq is None else per_seq / MB, digits=3),
                Cell(None if not (analytic and rows_in_wave) else analytic / rows_in_wave / MB, digits=3),
                Cell(ratio, digits=3), gap], rule_before=first and bool(rows)))
            first = False
        notes += _against_melt(task, result(next(v for v in KV_COMPRESSION.variants if v.name == "ouro-int4"), task),
                               base["melt"])
    return Table(
        key="beyond-the-paper",
        title="Beyond the paper: compressed KV caches",
        caption="Ouro and MELT with quantized caches (KIVI: keys per channel, values per token, groups of 32, the "
                "last 32 tokens in full precision) and Ouro's training-free cross-loop cache (loop 1 full, later "
                "loops int4 deltas; FlashLoop's idea). Score in percent ± one standard error.",
        stub_heads=["Task", "Row"],
        heads=["score", "KV per seq. measured (MB)", "formula (MB)", "x Ouro's bytes", "vs uncompressed"],
        rows=rows,
        notes=["KV per sequence: the peak cache the native engine allocated (Tensor.nbytes) over the rows of that "
               "wave, each allocated for the batch's longest prompt + max_new_tokens; formula: cache_layout's bytes "
               "for the same wave. vs uncompressed: points against the same model with its own-dtype cache, in "
               "paired standard errors over the same problems where both kept per-problem scores."] + notes,
        source="results",
    )


def _against_melt(task: str, ouro_int4, melt) -> list[str]:
    """Issue 40's question for a cache of MELT's bytes: Ouro with an int4 cache against MELT with its own, which
    wins and by how many paired standard errors."""
    from melt_eval.report.claims import _paired_stderr, problem_scores

    if ouro_int4 is None or melt is None:
        return []
    (a, _), (b, _) = _pct(ouro_int4, "accuracy"), _pct(melt, "accuracy")  # pass@1 where the task samples several
    if a is None or b is None:
        return []
    paired = _paired_stderr({task: problem_scores(ouro_int4)}, {task: problem_scores(melt)})
    winner = "MELT" if b > a else "Ouro, int4 cache" if a > b else "neither"
    from melt_eval.report.plots import bytes_per_sequence

    # int4 is MELT's bytes per token at T = 4 only past KIVI's full-precision window: say what was measured
    sizes = bytes_per_sequence(ouro_int4), bytes_per_sequence(melt)
    bytes_said = f"{sizes[0] / sizes[1]:.2f}x MELT's measured bytes" if all(sizes) else "about MELT's bytes per token"
    return [f"{task}: Ouro with an int4 cache ({bytes_said}) {a:.1f} against MELT {b:.1f}: {winner} "
            f"{'wins' if winner != 'neither' else '(equal)'} by {abs(a - b):.1f} points"
            + (f" = {abs(a - b) / (100 * paired):.1f} paired standard errors" if paired else "") + "."]
