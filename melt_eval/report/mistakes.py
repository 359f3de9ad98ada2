"""Where the wrong answers go wrong: the synthetic task's replies read step by step.

Pass@1 says how often a model is right; on the demo's digit-sum task the worked reply also says where
it first went wrong (`melt_eval.synthetic.first_mistake`): a wrong digit sum, a step started from the
wrong value, too few or too many steps, a reply out of the worked form, or every step right and the
boxed answer not the last result. The gates and the ladder's rows that score alike can fail in
different places, and the untrained sharing variants fail in their own way; this table shows which.

Read from each evaluation's `details.jsonl` (the completions and LightEval's verdicts) beside its
results.json, against the task's own test split, so it needs nothing but the results directory.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field

from melt_eval.errors import UserError
from melt_eval.jsonio import read_text
from melt_eval.report.render import Cell, Row, Table
from melt_eval.report.results import Result, ResultSet

TASK = "synthetic"
UNPLACED = "unplaced"  # wrong by the metric, no mistake found by the checker (the metric's verdict stands)


@dataclass
class Mistakes:
    completions: int = 0
    wrong: int = 0  # by the task's metric (LightEval's math verdict)
    never_right: int = 0  # problems none of whose samples is right
    kinds: Counter = field(default_factory=Counter)  # first mistake of each wrong completion
    right_but_flawed: int = 0  # right by the metric, with a mistake before the answer


def count_mistakes(result: Result, rows: list[dict]) -> Mistakes | None:
    """Tally one evaluation's replies; None when it has no details file or they are not of `rows`
    (another version of the task), so a table never mixes problems."""
    from melt_eval.synthetic import first_mistake

    path = result.path.parent / "details.jsonl"
    if not path.is_file():
        return None
    out = Mistakes()
    try:
        lines = [json.loads(line) for line in read_text(path, "a details.jsonl").splitlines() if line.strip()]
        for line in lines:
            row = rows[line["index"]]
            if str(line["gold"]) != row["answer"]:
                return None
            verdicts = [c["correct"] for c in line["completions"]]
            out.never_right += not any(verdicts)
            for c in line["completions"]:
                out.completions += 1
                found = first_mistake(row, c["text"])
                if not c["correct"]:
                    out.wrong += 1
                    out.kinds[found[1] if found else UNPLACED] += 1
                elif found is not None:
                    out.right_but_flawed += 1
    except (OSError, ValueError, KeyError, IndexError, TypeError, UserError):
        return None
    return out


def _entries(rs: ResultSet) -> list[tuple[str, Result]]:
    """(label, result) of every evaluation on the task: the main models, then each ablation's rows."""
    sweeps = rs.loop_sweep_dirs()
    out = [(model, r) for (model, task), r in rs.main.items() if task == TASK and model not in sweeps]
    out += [(f"{a}: {v}", r) for (a, v, task), r in rs.ablations.items() if task == TASK]
    return out


def counted_mistakes(rs: ResultSet) -> list[tuple[str, Mistakes]]:
    """(label, tally) of every evaluation on the task with a details file of the built-in test split."""
    from melt_eval.evaluation.data import load_rows
    from melt_eval.evaluation.tasks import SPECS

    entries = _entries(rs)
    if not entries:
        return []
    rows = load_rows(SPECS[TASK], None, None)
    return [(label, m) for label, r in entries if (m := count_mistakes(r, rows)) is not None]


def mistakes_json(rs: ResultSet) -> list[dict]:
    """For a script (the demo's report/mistakes.json): one object per evaluation, the table's figures."""
    return [{"model": label, "replies": m.completions, "wrong": m.wrong, "never_right": m.never_right,
             "first_mistake": dict(m.kinds), "right_but_flawed": m.right_but_flawed}
            for label, m in counted_mistakes(rs)]


def mistakes_table(rs: ResultSet) -> Table | None:
    """The first mistake of every wrong reply, per model; None where no result on the task has details."""
    from melt_eval.synthetic import MISTAKES

    counted = counted_mistakes(rs)
    if not counted:
        return None
    kinds = list(MISTAKES) + ([UNPLACED] if any(m.kinds[UNPLACED] for _, m in counted) else [])
    sizes = {m.completions for _, m in counted}
    same_size = len(sizes) == 1  # the usual case: the count goes in the title, not in a column of its own
    table_rows = [Row([label], ([] if same_size else [Cell(text=f"{m.completions:,}")])
                      + [Cell(text=f"{m.wrong:,}"), Cell(text=f"{m.never_right:,}")]
                      + [Cell(text=f"{m.kinds[k]:,}") for k in kinds] + [Cell(text=f"{m.right_but_flawed:,}")])
                  for label, m in counted]
    return Table(
        key="mistakes",
        title="Where the wrong answers go wrong (synthetic task"
        + (f", {next(iter(sizes)):,} replies each)" if same_size else ")"),
        caption="Wrong replies (of problems x samples), each counted once by its first mistake; problems "
        "none of whose samples is right (never right); right answers reached through a wrong step (right, flawed).",
        stub_heads=["Model"],
        heads=([] if same_size else ["Replies"]) + ["Wrong", "Never right"] + kinds + ["Right, flawed"],
        rows=table_rows,
        notes=[f"{k}: {text}." for k, text in MISTAKES.items()]
        + ([f"{UNPLACED}: wrong by the task's metric, no mistake found in the reply."] if UNPLACED in kinds else [])
        + ["Each step is checked against the reply's own previous result, so one wrong sum counts once."],
    )
