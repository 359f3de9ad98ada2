"""The paper's qualitative claims, each checked against a results directory (and against the paper's own numbers).

Every figure here is computed from results.json files (or from paper_results.json for the paper's
column); nothing is typed in. A claim whose results are missing reads n/a, never ✓. Scores are
pass@1 (accuracy for one-sample tasks), averaged over the tasks every compared model has.

Thresholds are fixed here, once, from the paper's wording; they are not tuned to the results:
  1. MELT keeps at least 90% of its teacher's pass@1 with a KV cache 1/T the size (the paper: 93-99%);
  2. every untrained KV-sharing variant scores below 25% of the teacher (the paper: 0);
  3. removing chunk-wise training collapses accuracy: below 25% of full MELT (the paper: 0);
  4. each other ladder component helps: every removal in the ladder lowers pass@1;
  5. the element-wise gate is the best gate: no other gate scores higher;
  6. accuracy rises with T while MELT's cache stays constant: MELT's pass@1 never falls as T grows,
     is higher at the largest T than at T = 1, and the cache its runs measured is the same at every T;
  7. the teacher needs its loops: its pass@1 at T = 1 is at most half its pass@1 at its largest T (issue
     39: a task a looped model solves in one loop cannot show what the loops, or MELT's shared cache over
     them, are for).

The comparisons (the ladder's steps, the gates, each step of T) also give each gap in standard errors of
the difference, and name the ones under `NOISE` of them: with 100 problems a point or two is within the
noise, and a reader should see when a ✓ or ✗ rests on it. The two models answer the same problems, so
the error of a gap is the paired one, from the per-problem differences in each evaluation's
details.jsonl (a problem both find hard counts once, not twice); only where either evaluation lacks its
per-problem scores are the results' own standard errors combined as if independent, which misstates it
by however much the two models' per-problem scores are correlated. Each gap records which it used. This
annotates; it never changes `holds`. `close_call` says whether the verdict rests on such a gap: a ✓ with a
step under NOISE standard errors, a ✗ whose every failing step is (another machine's floats, a rerun at
another seed, could turn it).

`claims_of_runs` checks the same claims in several runs (the demo at several seeds) for one table across
them (`melt-eval claims DIR...`): how many runs each claim holds in is what says whether it is robust. A run
can also be the claims.json a demo wrote (`read_saved_claims`): its verdicts are read as
saved, for runs whose results directories were not kept (a demo's results are megabytes, its claims.json a few
kilobytes), and the table says which runs were read so.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field, fields as dataclass_fields
from pathlib import Path

from melt_eval.errors import UserError
from melt_eval.jsonio import read_json, read_text
from melt_eval.protocol import variants
from melt_eval.report.results import Result, ResultSet, load_results
from melt_eval.report.render import printable

KEEP = 0.90  # claim 1
COLLAPSE = 0.25  # claims 2 and 3
UNTRAINED = tuple(v for v in variants.RUN_ORDER["kv-sharing"] if v != "ouro")
# each row removes one more component; no-chunk is claim 3's
LADDER = tuple(v for v in variants.LADDER if v != "no-chunk")
GATES = variants.GATE_VARIANTS
CACHE_TOLERANCE = 0.01  # relative: a measured cache ratio within 1% of 1/T is 1/T
LE = "\u2264"
GATE_CLAIM = "The element-wise gate is the best gate"
NEEDS_LOOPS = 0.5  # claim 7: the teacher at T = 1 scores at most this share of its pass@1 at the largest T
NOISE = 2.0  # gaps under this many standard errors are named as within the noise (annotation only)


@dataclass
class Claim:
    claim: str
    threshold: str
    measured: str | None = None  # the figures, with the names of the models that produced them
    brief: str | None = None  # the deciding figures in a few words: a cell of the table across runs
    holds: bool | None = None  # None: not measured (results missing)
    paper: str | None = None  # the same check on the paper's own numbers
    paper_holds: bool | None = None
    values: dict = field(default_factory=dict)  # the numbers behind `measured`
    close_call: bool | None = None  # the verdict rests on a gap under NOISE standard errors: a rerun could turn it

    def to_json(self) -> dict:
        return {"claim": self.claim, "measured": self.measured, "threshold": self.threshold, "holds": self.holds,
                "close_call": self.close_call, "brief": self.brief, "values": self.values, "paper": self.paper,
                "paper_holds": self.paper_holds}


def _first(result: Result) -> tuple[float, float | None] | None:
    return result.metric("pass@1") or result.metric("accuracy")


def first_score(result: Result) -> float | None:
    got = _first(result)
    return None if got is None else got[0]


def _pct(x: float) -> str:
    return f"{100 * x:.1f}"


# ------------------------------------------------------------------ who is who in a results directory


def _main_entry(rs: ResultSet, kind: str) -> tuple[str, dict[str, Result]] | None:
    """The main-table model of `kind` ("melt" or "ouro"): the paper's registry name first, then any
    model directory naming it (e.g. the demo's melt-tiny), never a run at another loop count."""
    sweeps = rs.loop_sweep_dirs()
    names = [m for m in rs.main_models() if m not in sweeps]
    preferred = {"melt": "melt-1.6b", "ouro": "ouro-1.4b-thinking"}[kind]
    name = preferred if preferred in names else next((m for m in names if kind in m.lower()), None)
    if name is None:
        return None
    return name, {t: r for (m, t), r in rs.main.items() if m == name}


def _variant(rs: ResultSet, ablation: str, variant: str) -> dict[str, Result]:
    return {t: r for (a, v, t), r in rs.ablations.items() if a == ablation and v == variant}


def producer_name(rs: ResultSet, ablation: str, variant: str) -> str | None:
    """The main-table name of the checkpoint an ablation row evaluated (same model_path), if it has one."""
    paths = {r.raw.get("model_path") for r in _variant(rs, ablation, variant).values()} - {None}
    sweeps = rs.loop_sweep_dirs()
    for (m, _), r in rs.main.items():
        if m not in sweeps and r.raw.get("model_path") in paths:
            return m
    return None


def _mean_over_shared(entries: dict[str, dict[str, Result]]) -> tuple[dict[str, float], list[str]] | None:
    """Mean first score per entry over the tasks every entry has (None if they share none)."""
    scored = {k: {t: s for t, r in v.items() if (s := first_score(r)) is not None} for k, v in entries.items()}
    if not scored or any(not v for v in scored.values()):
        return None
    shared = sorted(set.intersection(*(set(v) for v in scored.values())))
    if not shared:
        return None
    return {k: sum(v[t] for t in shared) / len(shared) for k, v in scored.items()}, shared


def _stderr_over_shared(entries: dict[str, dict[str, Result]], shared: list[str]) -> dict[str, float | None]:
    """The standard error of each entry's mean over `shared` tasks (None where a task has none)."""
    out = {}
    for k, results in entries.items():
        errs = [_first(results[t])[1] for t in shared]  # every shared task has a score
        out[k] = None if any(e is None for e in errs) else sum(e * e for e in errs) ** 0.5 / len(errs)
    return out


def problem_scores(result: Result) -> dict[tuple, float] | None:
    """The per-problem scores LightEval averaged into the result's first score, from the details.jsonl beside
    its results.json: {(index, gold): score}. None where there is no such file, a row lacks the score, or
    the scores do not average to the result's (details of another evaluation)."""
    name = "pass@1" if "pass@1" in result.metrics else "accuracy"
    value = first_score(result)
    try:
        lines = read_text(result.path.parent / "details.jsonl", "a details.jsonl").splitlines()
        rows = [json.loads(line) for line in lines if line.strip()]
        scores = {(r["index"] if r["index"] is not None else i, str(r["gold"])): float(r["metrics"][name])
                  for i, r in enumerate(rows)}
    except (OSError, ValueError, TypeError, KeyError, UserError):
        return None
    if not scores or len(scores) != len(rows) or value is None or abs(sum(scores.values()) / len(scores) - value) > 1e-6:
        return None
    return scores


def _paired_stderr(a: dict[str, dict | None], b: dict[str, dict | None]) -> float | None:
    """The standard error of (mean a - mean b) over the tasks of `a` and `b` ({task: `problem_scores`}) from the
    per-problem differences; None unless both kept their scores for the same problems (two or more) in every task."""
    variance = 0.0
    for task, sa in a.items():
        sb = b[task]
        if sa is None or sb is None or sa.keys() != sb.keys() or len(sa) < 2:
            return None
        variance += statistics.variance([sa[k] - sb[k] for k in sa]) / len(sa)
    return variance ** 0.5 / len(a)


def _gaps_in_stderr(pairs: dict[str, tuple[str, str]], means: dict[str, float], entries: dict[str, dict[str, Result]],
                    shared: list[str], stderr: dict[str, float | None]) -> tuple[dict[str, float | None], dict[str, str]]:
    """For each named pair (a, b): (mean a - mean b) / the standard error of that difference, paired where
    both kept per-problem scores, else from `stderr` as if independent; None where an error is missing or
    is 0 (two scores at the ceiling or the floor). Also which error each gap used: "paired" or "independent"."""
    per_problem: dict[str, dict] = {}  # each evaluation's details are read once, however many pairs it is in

    def scores(name: str) -> dict:
        if name not in per_problem:
            per_problem[name] = {t: problem_scores(entries[name][t]) for t in shared}
        return per_problem[name]

    gaps, methods = {}, {}
    for name, (a, b) in pairs.items():
        se = _paired_stderr(scores(a), scores(b))
        methods[name] = "paired" if se is not None else "independent"
        if se is None:
            ea, eb = stderr.get(a), stderr.get(b)
            se = None if ea is None or eb is None else (ea * ea + eb * eb) ** 0.5
        gaps[name] = (means[a] - means[b]) / se if se else None
    return gaps, methods


def _under_noise(gaps: dict[str, float | None]) -> dict[str, float]:
    """The gaps under NOISE standard errors (a gap with no error, two identical sets of scores, is not)."""
    return {k: z for k, z in gaps.items() if z is not None and abs(z) < NOISE}


def _close_call(gaps: dict[str, float | None], failing: set[str]) -> bool:
    """Whether a verdict decided by the signs of `gaps` could turn on a rerun: a ✓ if any gap is under NOISE
    standard errors, a ✗ if every failing gap is."""
    near = _under_noise(gaps)
    return failing <= near.keys() if failing else bool(near)


def _nearest_noise(gaps: dict[str, float | None]) -> str:
    """For a brief: the gap nearest zero, if it is under NOISE standard errors (the step a rerun could most easily
    turn), e.g. ' (T 1->2 +0.1 se)'; '' if none is."""
    close = _under_noise(gaps)
    if not close:
        return ""
    step = min(close, key=lambda k: abs(close[k]))
    return f" ({step} {close[step]:+.1f} se)"


def _within_noise(gaps: dict[str, float | None], changes: dict[str, float]) -> str:
    """The measured-text note naming the gaps under NOISE standard errors ('' if none); `changes`: each
    gap's signed difference in pass@1 as the text should read it."""
    close = [f"{name} {100 * changes[name] + 0.0:+.1f} ({abs(z):.1f} se)" for name, z in _under_noise(gaps).items()]
    return f"; within {NOISE:g} standard errors: " + ", ".join(close) if close else ""


# ------------------------------------------------------------------ the checks (ours)


def _keeps_teacher(rs: ResultSet, claim: Claim) -> None:
    melt, teacher = _main_entry(rs, "melt"), _main_entry(rs, "ouro")
    melt = melt or ("MELT", _variant(rs, "components", "full"))
    teacher = teacher or ("the LoopLM", _variant(rs, "kv-sharing", "ouro"))
    got = _mean_over_shared({"melt": melt[1], "teacher": teacher[1]})
    if got is None:
        return
    means, tasks = got
    claim.values = {"melt": melt[0], "teacher": teacher[0], "tasks": tasks, "melt_pass@1": means["melt"],
                    "teacher_pass@1": means["teacher"]}
    if not means["teacher"]:
        claim.measured = f"{teacher[0]} (the teacher) scores 0.0: no ratio to take"
        return
    ratio = claim.values["ratio"] = means["melt"] / means["teacher"]
    caches = [(melt[1][t].raw.get("peak_cache_bytes"), teacher[1][t].raw.get("peak_cache_bytes"),
               teacher[1][t].settings.get("loops")) for t in tasks]
    caches = [c for c in caches if all(c)]
    text = f"{melt[0]} {_pct(means['melt'])} / {teacher[0]} {_pct(means['teacher'])} = {ratio:.2f}"
    cache_ok = None
    if caches:
        melt_bytes, teacher_bytes, loops = caches[0]
        cache_ratio = melt_bytes / teacher_bytes
        cache_ok = all(abs(m / t * lp - 1) <= CACHE_TOLERANCE for m, t, lp in caches)
        claim.values.update(cache_ratio=cache_ratio, loops=loops)
        text += f"; cache {cache_ratio:.3f}x at T = {loops}"
    else:
        text += "; cache not recorded"
    claim.measured = text
    claim.brief = f"{_pct(means['melt'])} / {_pct(means['teacher'])} = {ratio:.2f}" + \
        (f", cache {claim.values['cache_ratio']:.3f}x" if caches else ", cache not recorded")
    claim.holds = ratio >= KEEP and cache_ok is not False


def _untrained_collapse(rs: ResultSet, claim: Claim) -> None:
    entries = {"ouro": _variant(rs, "kv-sharing", "ouro")}
    entries.update({v: _variant(rs, "kv-sharing", v) for v in UNTRAINED if _variant(rs, "kv-sharing", v)})
    got = _mean_over_shared(entries) if len(entries) > 1 else None
    if got is None:
        return
    means, _ = got
    if not means["ouro"]:
        claim.measured = "the teacher scores 0.0: no ratio to take"
        return
    ratios = {v: means[v] / means["ouro"] for v in UNTRAINED if v in means}
    worst = max(ratios, key=ratios.get)
    claim.values = {"teacher_pass@1": means["ouro"], "ratios": ratios}
    claim.measured = ", ".join(f"{v} {r:.2f}" for v, r in ratios.items()) + f" of the teacher (max: {worst})"
    claim.brief = f"at most {ratios[worst]:.2f} ({worst})"
    missing = [v for v in UNTRAINED if v not in ratios]
    if missing:
        claim.measured += f"; not run: {', '.join(missing)}"
    claim.holds = None if missing else all(r < COLLAPSE for r in ratios.values())


def _chunk_collapse(rs: ResultSet, claim: Claim) -> None:
    got = _mean_over_shared({"full": _full(rs), "no-chunk": _variant(rs, "components", "no-chunk")})
    if got is None:
        return
    means, _ = got
    if not means["full"]:
        claim.measured = "full MELT scores 0.0: no ratio to take"
        return
    ratio = means["no-chunk"] / means["full"]
    claim.values = {"full_pass@1": means["full"], "no_chunk_pass@1": means["no-chunk"], "ratio": ratio}
    claim.measured = f"{_pct(means['no-chunk'])} against {_pct(means['full'])} = {ratio:.2f} of full MELT"
    claim.brief = f"{_pct(means['no-chunk'])} vs {_pct(means['full'])} = {ratio:.2f}"
    claim.holds = ratio < COLLAPSE


def _full(rs: ResultSet) -> dict[str, Result]:
    return _variant(rs, "components", "full") or (_main_entry(rs, "melt") or ("", {}))[1]


def _ladder(rs: ResultSet, claim: Claim) -> None:
    entries = {v: _variant(rs, "components", v) for v in LADDER}
    entries["full"] = entries["full"] or _full(rs)
    entries["no-align"] = entries["no-align"] or _variant(rs, "gates", "elementwise")  # the same run
    got = _mean_over_shared(entries)
    if got is None:
        return
    means, shared = got
    steps = {f"-{b[3:]}": (a, b) for a, b in zip(LADDER, LADDER[1:])}
    drops = {k: means[a] - means[b] for k, (a, b) in steps.items()}
    stderr = _stderr_over_shared(entries, shared)
    gaps, methods = _gaps_in_stderr(steps, means, entries, shared, stderr)
    claim.values = {"pass@1": means, "drops": drops, "stderr": stderr, "drops_in_stderr": gaps,
                    "drops_stderr_method": methods}
    claim.measured = ", ".join(f"{v} {_pct(means[v])}" for v in LADDER)
    claim.brief = _pct(means[LADDER[0]]) + "".join(
        f" {'>' if drops[k] > 0 else LE} {_pct(means[b])}" for k, (_, b) in steps.items())
    claim.holds = all(d > 0 for d in drops.values())
    if not claim.holds:
        claim.measured += "; " + ", ".join(f"removing {k[1:]} changes {100 * -d + 0.0:+.1f}" for k, d in drops.items() if d <= 0)
    claim.measured += _within_noise(gaps, {k: -d for k, d in drops.items()})  # what each removal changes
    claim.brief += _nearest_noise({k: -z if z is not None else None for k, z in gaps.items()})  # as the note reads it
    claim.close_call = _close_call(gaps, {k for k, d in drops.items() if d <= 0})


def _best_gate(rs: ResultSet, claim: Claim) -> None:
    entries = {g: _variant(rs, "gates", g) for g in GATES}
    entries["elementwise"] = entries["elementwise"] or _variant(rs, "components", "no-align")
    entries = {g: e for g, e in entries.items() if e}
    if "elementwise" not in entries or len(entries) < 2:
        return
    got = _mean_over_shared(entries)
    if got is None:
        return
    means, shared = got
    best_other = max((g for g in means if g != "elementwise"), key=means.get)
    stderr = _stderr_over_shared(entries, shared)
    lead = f"elementwise - {best_other}"
    gaps, methods = _gaps_in_stderr({lead: ("elementwise", best_other)}, means, entries, shared, stderr)
    claim.values = {"pass@1": means, "stderr": stderr, "lead_in_stderr": gaps[lead], "lead_stderr_method": methods[lead]}
    claim.measured = f"elementwise {_pct(means['elementwise'])}; best other: {best_other} {_pct(means[best_other])}"
    claim.brief = f"{_pct(means['elementwise'])}; {best_other} {_pct(means[best_other])}" + \
        ("" if gaps[lead] is None else f" ({gaps[lead]:+.1f} se)")
    claim.measured += _within_noise(gaps, {lead: means["elementwise"] - means[best_other]})
    claim.holds = means["elementwise"] >= means[best_other]
    claim.close_call = _close_call(gaps, set() if claim.holds else {lead})


def _rises_with_loops(rs: ResultSet, claim: Claim) -> None:
    from melt_eval.report.plots import loops_points, loops_task

    lines = {label: ps for label, ps in loops_points(rs).items() if "melt" in label.lower() and "kv-sharing" not in label}
    if not lines:
        return
    label, points = next(iter(lines.items()))
    acc = [p.accuracy for p in points]
    cache = [p.measured_mb for p in points]
    if any(a is None for a in acc):
        return
    rising = all(b >= a for a, b in zip(acc, acc[1:])) and acc[-1] > acc[0]
    constant = None if any(c is None for c in cache) else max(cache) - min(cache) <= CACHE_TOLERANCE * max(cache)
    # each step T -> T' in standard errors of the difference, like the ladder's: two scores near the floor
    # (a model run with fewer loops than it was trained for) can swap on another machine's floats
    task = loops_task(rs)
    entries = {f"T={p.loops}": {task: p.result} for p in points}
    means = {f"T={p.loops}": a / 100 for p, a in zip(points, acc)}
    stderr = _stderr_over_shared(entries, [task])
    steps = {f"T {a.loops}->{b.loops}": (f"T={b.loops}", f"T={a.loops}") for a, b in zip(points, points[1:])}
    gaps, methods = _gaps_in_stderr(steps, means, entries, [task], stderr)
    claim.values = {"model": label, "loops": [p.loops for p in points], "pass@1": [a / 100 for a in acc],
                    "cache_mb": cache, "rises_in_stderr": gaps, "rises_stderr_method": methods}
    claim.measured = f"{label} pass@1 " + " / ".join(f"{a:.1f}" for a in acc) + " at T = " + \
        ",".join(str(p.loops) for p in points)
    claim.measured += "; cache not recorded" if constant is None else \
        "; cache " + " / ".join(f"{c:.2f}" for c in cache) + " MiB"
    claim.measured += _within_noise(gaps, {k: means[a] - means[b] for k, (a, b) in steps.items()})
    claim.brief = " / ".join(f"{a:.1f}" for a in acc) + ("; cache not recorded" if constant is None else
                                                         "; cache constant" if constant else "; cache varies")
    claim.brief += _nearest_noise(gaps)
    claim.holds = rising and constant is not False
    if constant is not False:  # a cache that varies decides the claim whatever the scores
        claim.close_call = _close_call(gaps, {k for k, (a, b) in steps.items() if means[a] < means[b]})


def _teacher_needs_loops(rs: ResultSet, claim: Claim) -> None:
    from melt_eval.report.plots import loops_points

    # the teacher's line of the loops figure: its evaluations at T = 1..4 (the untrained sharing rows and MELT aside)
    lines = {label: ps for label, ps in loops_points(rs).items()
             if "melt" not in label.lower() and "kv-sharing" not in label}
    label = next((k for k in lines if "ouro" in k.lower()), next(iter(lines), None))
    if label is None:
        return
    points = lines[label]
    if any(p.accuracy is None for p in points):
        return
    if points[0].loops != 1:  # e.g. `demo --quick`, which runs T = 2 and 4: said, and left n/a
        claim.measured = f"{label} not evaluated at T = 1 (only T = {', '.join(str(p.loops) for p in points)})"
        return
    one, full = points[0].accuracy / 100, points[-1].accuracy / 100
    claim.values = {"model": label, "loops": [p.loops for p in points], "pass@1": [p.accuracy / 100 for p in points]}
    claim.measured = f"{label} pass@1 {_pct(one)} at T = 1, {_pct(full)} at T = {points[-1].loops}"
    if not full:
        claim.measured += ": no ratio to take"
        return
    ratio = claim.values["ratio"] = one / full
    claim.measured += f" = {ratio:.2f}"
    claim.brief = f"{_pct(one)} / {_pct(full)} = {ratio:.2f}"
    claim.holds = ratio <= NEEDS_LOOPS


CHECKS = [
    ("MELT keeps at least 90% of its teacher's pass@1 with a KV cache 1/T the size",
     f"MELT / teacher >= {KEEP:.2f}, cache = 1/T", _keeps_teacher),
    ("Every untrained KV-sharing variant scores below 25% of the teacher",
     f"each variant / teacher < {COLLAPSE:.2f}", _untrained_collapse),
    ("Removing chunk-wise training collapses accuracy",
     f"- chunk-wise / full MELT < {COLLAPSE:.2f}", _chunk_collapse),
    ("Each other ladder component helps",
     "every removal lowers pass@1", _ladder),
    (GATE_CLAIM, "elementwise >= every other gate", _best_gate),
    ("Accuracy rises with T while MELT's cache stays constant",
     "MELT pass@1 never falls as T grows, cache equal at every T", _rises_with_loops),
    ("The teacher needs its loops",
     f"teacher pass@1 at T = 1 {LE} {NEEDS_LOOPS:g}x at the largest T", _teacher_needs_loops),
]


# ------------------------------------------------------------------ the same checks on the paper's numbers


def _paper_checks() -> list[tuple[str | None, bool | None]]:
    from melt_eval.protocol.labels import MAIN_MODELS
    from melt_eval.report.paper import ABLATIONS, paper_memory, paper_results

    pr = paper_results()

    def mean_first(scores: dict) -> float:
        firsts = [next(iter(m.values())) for m in scores.values()]
        return sum(firsts) / len(firsts)

    def section(ablation: str) -> dict[str, float]:
        info = ABLATIONS[ablation]
        return {v: mean_first(pr[info["section"]][key]) for v, (key, _) in info["variants"].items()}

    main = pr["main_comparison"]["scores"]
    melt_key, ouro_key = MAIN_MODELS["melt-1.6b"], MAIN_MODELS["ouro-1.4b-thinking"]
    melt, ouro = mean_first(main[melt_key]), mean_first(main[ouro_key])
    cache = paper_memory(melt_key)["kv_mb_per_token"] / paper_memory(ouro_key)["kv_mb_per_token"]
    kv, comp, gates = section("kv-sharing"), section("components"), section("gates")
    untrained = {v: kv[v] / kv["ouro"] for v in UNTRAINED}
    drops = [comp[a] - comp[b] for a, b in zip(LADDER, LADDER[1:])]
    best_other = max((g for g in GATES if g != "elementwise"), key=gates.get)
    return [
        (f"MELT-1.6B {melt:.1f} / Ouro {ouro:.1f} = {melt / ouro:.2f}; cache {cache:.3f}x", melt / ouro >= KEEP),
        ("max " + f"{max(untrained.values()):.2f}", all(r < COLLAPSE for r in untrained.values())),
        (f"{comp['no-chunk']:.1f} against {comp['full']:.1f}", comp["no-chunk"] / comp["full"] < COLLAPSE),
        (", ".join(f"{v} {comp[v]:.1f}" for v in LADDER), all(d > 0 for d in drops)),
        (f"elementwise {gates['elementwise']:.1f}; best other: {best_other} {gates[best_other]:.1f}",
         gates["elementwise"] >= gates[best_other]),
        (None, None),  # the paper shows this in a figure; paper_results.json holds no per-T numbers
        (None, None),  # the paper reports Ouro at its trained T = 4 only: paper_results.json has no Ouro at T = 1
    ]


def paper_claims(rs: ResultSet) -> list[Claim]:
    """Each claim measured on `rs`, with the same check on the paper's numbers (averaged over its
    ablation benchmarks, pass@1 or accuracy) beside it."""
    out = []
    for (text, threshold, check), (paper, paper_holds) in zip(CHECKS, _paper_checks()):
        claim = Claim(text, threshold, paper=paper, paper_holds=paper_holds)
        check(rs, claim)
        out.append(claim)
    return out


# ------------------------------------------------------------------ the same claims across runs (seeds)


@dataclass
class RunClaims:
    label: str  # "seed 3" for a demo directory, else the directory's name
    path: Path
    claims: list[Claim]
    saved: bool = False  # read back from a claims.json (`read_saved_claims`), not computed from results
    float_path: dict | None = None  # what computed it (melt_eval/float_path.py): demo.json's, else a results.json's

    @property
    def holding(self) -> int:
        return sum(c.holds is True for c in self.claims)

    @property
    def close_calls(self) -> int:
        return sum(c.close_call is True for c in self.claims)


def results_root(directory: Path) -> Path:
    """A demo's output directory holds its results under results/; anything else is a results root."""
    return directory / "results" if (directory / "results").is_dir() else directory


MAX_SEED = 2**32 - 1  # the demo's --seed cap


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _demo_record(directory: Path) -> dict | None:
    """The demo.json of a demo's output directory (None where there is none, or none readable). Its seed (the run's
    label) and flags must be what the demo writes: a seed of true, -1 or a string is refused, not printed."""
    try:
        demo = json.loads(read_text(directory / "demo.json", "a demo.json"))
    except (OSError, ValueError, UserError):
        return None
    if not isinstance(demo, dict) or demo.get("seed") is None:
        return None
    seed = demo["seed"]
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise UserError(f"{directory / 'demo.json'} holds seed {_short(seed)}, not a whole number 0 to {MAX_SEED} as the "
                        "demo writes it; mend or move the file aside")
    for flag in ("quick", "compile"):
        if demo.get(flag) is not None and not isinstance(demo[flag], bool):
            raise UserError(f"{directory / 'demo.json'} holds {flag} {_short(demo[flag])}, not true or false; "
                            "mend or move the file aside")
    return demo


def _demo_label(demo: dict | None) -> str | None:
    if demo is None:
        return None
    return f"seed {demo['seed']}" + (" (--quick)" if demo.get("quick") else "")


def _run_directory(path: Path) -> Path:
    """The run a path stands for: a directory itself; for a claims.json, the demo directory of
    DIR/report/claims.json, else the directory holding the file."""
    if path.is_dir():
        return path
    return path.parent.parent if path.parent.name == "report" else path.parent


# what each key of a claim's `values` holds: (lowest, highest, None allowed); any key holding "pass@1" is a fraction,
# the other keys (model and task names, which error a gap used) hold text
_VALUE_RANGES = {"drops": (-1, 1, False), "ratio": (0, math.inf, False), "ratios": (0, math.inf, False),
                 "cache_ratio": (0, math.inf, False), "cache_mb": (0, math.inf, True), "loops": (1, math.inf, False),
                 "stderr": (0, 1, True), "drops_in_stderr": (-math.inf, math.inf, True),
                 "rises_in_stderr": (-math.inf, math.inf, True), "lead_in_stderr": (-math.inf, math.inf, True)}


def _bad_value(values: dict) -> str | None:
    """The first entry of a saved claim's `values` no check computes, said for an error ('values.pass@1.scalar is
    nan, not a number from 0 to 1'): a number not finite or out of its key's range, loops not whole, text where
    a number belongs or a number where text does; None if all are well formed."""
    stack = [(f"values.{k}", k, v) for k, v in values.items()]
    while stack:
        where, key, v = stack.pop()
        if isinstance(v, dict):
            stack += [(f"{where}.{k}", key, x) for k, x in v.items()]
            continue
        if isinstance(v, list):
            stack += [(f"{where}[{i}]", key, x) for i, x in enumerate(v)]
            continue
        low, high, none = (0, 1, False) if "pass@1" in key else _VALUE_RANGES.get(key, (None, None, True))
        if low is None:  # text
            if not (v is None or isinstance(v, str)):
                return f"{printable(where)} is {_short(v)}, not text"
        elif v is None:
            if not none:
                return f"{printable(where)} is null, not a number"
        elif (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not low <= v <= high
              or key == "loops" and not isinstance(v, int)):
            return f"{printable(where)} is {_short(v)}, not a {'whole ' if key == 'loops' else ''}number " + \
                (f"from {low:g} to {high:g}" if math.isfinite(high) else f"of at least {low:g}" if math.isfinite(low)
                 else "(finite)")
    return None


def read_saved_claims(path: Path) -> list[Claim]:
    """A claims.json (`Claim.to_json` of each claim, in order) back into Claims. It must hold this version's
    claims, in this version's order and with its thresholds: a file another version wrote, with other claims
    or thresholds, would put unlike verdicts side by side."""
    data = read_json(path, "a claims.json")
    expected = [(text, threshold) for text, threshold, _ in CHECKS]
    fields = {f.name for f in dataclass_fields(Claim)}  # what `Claim.to_json` writes
    def well_formed(c) -> bool:
        if not (isinstance(c, dict) and fields <= set(c) and isinstance(c["values"], dict)):
            return False
        texts = all(c[k] is None or isinstance(c[k], str) for k in ("measured", "brief", "paper"))
        verdicts = all(c[k] is None or isinstance(c[k], bool) for k in ("holds", "close_call", "paper_holds"))
        scores = c["values"].get("pass@1", {}) if c["claim"] == GATE_CLAIM else {}  # the gate pairs' arithmetic
        numbers = isinstance(scores, dict) and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                   and 0 <= v <= 1 for v in scores.values())  # pass@1: NaN fails too
        return texts and verdicts and numbers

    if (not isinstance(data, list) or not all(well_formed(c) for c in data)
            or [(c["claim"], c["threshold"]) for c in data] != expected):
        raise UserError(f"{path} does not hold this version's {len(expected)} claims as the demo writes them; "
                        "pass the run's directory to check its results again")
    for i, c in enumerate(data, 1):  # every number, not only the gate's: NaN or Infinity would print as NaN
        if (bad := _bad_value(c["values"])) is not None:
            raise UserError(f"{path} does not hold this version's {len(expected)} claims as the demo writes them "
                            f"(claim {i}: {bad}); pass the run's directory to check its results again")
    return [Claim(**{k: c[k] for k in fields}) for c in data]


def claims_of_runs(paths: list[Path]) -> list[RunClaims]:
    """Each run's claims, computed from its results, or read as saved where the path is a claims.json file;
    labelled by the demo's seed where the run is a demo's; directory names where the seeds would not tell runs
    apart. Refused (UserError): a run given twice or copied (it would count twice in "holds in"), --quick demos beside
    full ones (a quick demo's numbers mean nothing), and results that cannot be read (a claim would read as
    not run where its results are damaged)."""
    directories = [_run_directory(p) for p in paths]
    seen: dict[Path, Path] = {}
    for p, d in zip(paths, directories):
        key = results_root(d).resolve()  # a demo's directory, its results/ and its report/claims.json: one run
        if key in seen:
            raise UserError(f"{seen[key]} and {p} are the same run ({d}); pass each run once")
        seen[key] = p
    demos = [_demo_record(d) for d in directories]
    sizes = {bool(demo.get("quick")) for demo in demos if demo is not None}
    if len(sizes) > 1:
        quick = next(d for d, demo in zip(directories, demos) if demo is not None and demo.get("quick"))
        raise UserError(f"{quick} is a --quick demo, beside full ones: its numbers mean nothing next to theirs; "
                        "pass runs of one size")
    labels = [_demo_label(demo) for demo in demos]
    if None in labels or len(set(labels)) < len(labels):
        labels = [d.name or str(d) for d in directories]
        if len(set(labels)) < len(labels):
            labels = [str(p) for p in paths]
    runs = [RunClaims(label, d, read_saved_claims(p), saved=True, float_path=_float_path(d, demo)) if p.is_file()
            else RunClaims(label, d, paper_claims(_readable_results(results_root(d))), float_path=_float_path(d, demo))
            for label, d, p, demo in zip(labels, directories, paths, demos)]
    _refuse_copies(runs, paths, demos)
    return runs


_SETTINGS = ("seed", "quick", "compile")  # what demo.json says a demo ran with


def _refuse_copies(runs: list[RunClaims], paths: list[Path], demos: list[dict | None]) -> None:
    """Two runs with the same results (every claim's figures, to the last digit) and, where both are demos, the same
    seed and settings are one run, copied (cp -r DEMO DEMO2, or its claims.json): refused, or it would count twice
    in "holds in". The same seed on another float path gives other figures, so it stays a second run."""
    results = [json.dumps([c.to_json() for c in r.claims], sort_keys=True, default=str) for r in runs]
    for j in range(len(runs)):
        for i in range(j):
            a, b = demos[i], demos[j]
            if results[i] != results[j] or a is not None and b is not None and \
                    [a.get(k) for k in _SETTINGS] != [b.get(k) for k in _SETTINGS]:
                continue
            why = f"seed {a['seed']}, the same settings and the same results" if a is not None and b is not None \
                else "the same results to the last digit"
            raise UserError(f"{paths[i]} and {paths[j]} are the same run ({why}): a copy counts once; pass each run once")


def _float_path(directory: Path, demo: dict | None) -> dict | None:
    """The float path a run recorded: its demo.json's, else the first results.json's that has one."""
    if demo is not None:
        return _checked_float_path(demo.get("float_path"), directory / "demo.json")
    for f in sorted(results_root(directory).glob("**/results.json")):
        try:
            recorded = json.loads(f.read_text()).get("float_path")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(recorded, dict):
            return _checked_float_path(recorded, f)
    return None


def _checked_float_path(recorded, where: Path) -> dict | None:
    """A recorded float path whose fields are plain values (its note compares and prints them): a list would be a
    TypeError, NaN never equal to itself."""
    if not isinstance(recorded, dict):
        return None
    for k, v in recorded.items():
        if not (v is None or isinstance(v, (str, bool, int)) or isinstance(v, float) and math.isfinite(v)):
            raise UserError(f"{where} records float_path.{printable(k)} as {_short(v)}, not a plain value as the harness "
                            "writes it; mend or move the file aside")
    return recorded


def float_path_note(runs: list[RunClaims]) -> str | None:
    """One line where the runs compared were not computed on one float path (so equal seeds need not agree)."""
    from melt_eval import float_path

    keys = {float_path.key(r.float_path) for r in runs}
    if len(runs) < 2 or len(keys) == 1:
        return None
    paths = printable("; ".join(f"{r.label}: {float_path.label(r.float_path)}" for r in runs))  # text from files
    return f"note: these runs were computed on different float paths, so their figures differ by more than the seed ({paths})"


def _readable_results(root: Path) -> ResultSet:
    rs = load_results(root)
    if rs.unreadable:
        more = f" (and {len(rs.unreadable) - 1} more)" if len(rs.unreadable) > 1 else ""
        first = rs.unreadable[0].removesuffix("; skipped")
        raise UserError(f"{first}{more}: the claims are not decided from damaged results; "
                        "mend or move the file aside, or run its evaluation again")
    return rs


@dataclass
class HeadToHead:
    """The element-wise gate against one other gate across runs."""

    at_least_as_high: int  # runs where the element-wise gate scores at least as high
    runs: int  # runs measuring both
    mean_gap: float  # element-wise minus the other gate, pass@1, mean over the runs
    gap_stderr: float | None  # the standard error of that mean from its spread over the runs (None with one run)


def gate_head_to_head(runs: list[RunClaims]) -> dict[str, HeadToHead]:
    """Element-wise against each other gate on its own, across runs. The claim compares against the best of
    the others in each run, and when two gates are as good as the element-wise one the best of them wins
    most runs by chance alone; the pairs say which gate it is really behind, and the mean gap with its
    spread over the runs (seeds) says by how much, beyond the noise of any one run."""
    gaps: dict[str, list[float]] = {}
    for r in runs:
        scores = next((c.values.get("pass@1") or {} for c in r.claims if c.claim == GATE_CLAIM), {})
        if "elementwise" not in scores:
            continue
        for g, v in scores.items():
            if g != "elementwise":
                gaps.setdefault(g, []).append(scores["elementwise"] - v)
    return {g: HeadToHead(sum(d >= 0 for d in ds), len(ds), statistics.fmean(ds),
                          statistics.stdev(ds) / len(ds) ** 0.5 if len(ds) > 1 else None)
            for g, ds in gaps.items()}


def across_json(runs: list[RunClaims]) -> dict:
    """For a script: each claim with its verdict and figures in every run, and how many runs it holds in."""
    claims = []
    for i, first in enumerate(runs[0].claims):
        per_run = [r.claims[i] for r in runs]
        claims.append({
            "claim": first.claim, "threshold": first.threshold,
            "holds_in": sum(c.holds is True for c in per_run), "measured_in": sum(c.holds is not None for c in per_run),
            "close_calls": sum(c.close_call is True for c in per_run),
            "runs": [{"label": r.label, "holds": c.holds, "close_call": c.close_call, "brief": c.brief,
                      "measured": c.measured, "values": c.values}
                     for r, c in zip(runs, per_run)],
            "paper": first.paper, "paper_holds": first.paper_holds,
        })
    return {"runs": [{"label": r.label, "path": str(r.path), "claims_hold": r.holding, "close_calls": r.close_calls,
                      "claims": len(r.claims), "verdicts": "read from claims.json" if r.saved else "computed from results",
                      "float_path": r.float_path}
                     for r in runs],
            "float_path_note": float_path_note(runs),
            "claims": claims,
            "gate_head_to_head": {g: {"elementwise_at_least_as_high": h.at_least_as_high, "runs": h.runs,
                                      "mean_gap": h.mean_gap, "gap_stderr": h.gap_stderr}
                                  for g, h in gate_head_to_head(runs).items()}}
