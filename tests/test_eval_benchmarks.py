"""Scoring against the real benchmark copies in ../shared/benchmarks, and LightEval's pass@k estimator."""

from __future__ import annotations

import json
import random
from math import comb

import pytest
from lighteval.metrics.metrics_sample import PassAtK

from melt_eval.evaluation import score_completions
from melt_eval.evaluation.tasks import SPECS, boxed_gold

FINAL = "Therefore, the final answer is: $\\boxed{{{}}}$. I hope it is correct"
# LightEval's extraction (not math-verify's own parse) fails on these three OlympiadBench golds;
# they are the only misses of the whole file.
OLYMPIAD_UNREADABLE = {"$m_{\\max }=n^{2}-n-1$", "$(-\\infty, 0) \\cup\\{1\\}$.", "$t(0,4]$"}


def _rows(shared_benchmarks, task):
    return [json.loads(line) for line in (shared_benchmarks / f"{task}.jsonl").read_text().splitlines()]


def _score(tmp_path, shared_benchmarks, task, picks: dict[int, str]):
    path = tmp_path / f"{task}.jsonl"
    path.write_text("".join(json.dumps({"index": i, "completions": [FINAL.format(a)]}) + "\n" for i, a in picks.items()))
    return score_completions(task, path, data_dir=shared_benchmarks)


@pytest.mark.parametrize("task, step", [("aime24", 1), ("aime25", 1), ("amc23", 1), ("math500", 3), ("olympiadbench", 4)])
def test_gold_scores_full_marks_and_another_problems_answer_scores_zero(tmp_path, shared_benchmarks, task, step):
    rows = _rows(shared_benchmarks, task)
    assert len(rows) == SPECS[task].num_problems
    picked = range(0, len(rows), step)  # every row of the small sets, an even spread of the large ones
    answer = lambda r: r["answer"].strip().strip("$").rstrip(".").strip("$")  # noqa: E731  how a model would box it
    gold = _score(tmp_path, shared_benchmarks, task, {i: answer(rows[i]) for i in picked})
    missed = {rows[d["index"]]["answer"] for d in gold["details"] if not d["completions"][0]["correct"]}
    assert missed <= (OLYMPIAD_UNREADABLE if task == "olympiadbench" else set())
    value = gold["metrics"]["pass@1" if SPECS[task].samples > 1 else "accuracy"]["value"]
    assert value == (1.0 if task != "olympiadbench" else pytest.approx(1 - len(missed) / len(picked)))

    # each completion carries the next problem's answer: right only where two problems share an answer
    shifted = _score(tmp_path, shared_benchmarks, task, {i: answer(rows[(i + 1) % len(rows)]) for i in picked})
    value = shifted["metrics"]["pass@1" if SPECS[task].samples > 1 else "accuracy"]["value"]
    same = sum(rows[i]["answer"] == rows[(i + 1) % len(rows)]["answer"] for i in picked)
    assert same / len(picked) <= value <= (same + 1) / len(picked) and value < 0.1


def test_boxed_gold_strips_dollars_and_full_stops():
    assert boxed_gold("$t(0,4]$.") == "$\\boxed{t(0,4]}$"
    assert boxed_gold(" 204 ") == "$\\boxed{204}$"


def test_lighteval_pass_at_k_is_the_unbiased_estimator():
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 64)
        k = rng.randint(1, n)
        c = rng.randint(0, n)
        scores = [1] * c + [0] * (n - c)
        rng.shuffle(scores)
        direct = 1 - comb(n - c, k) / comb(n, k)
        assert PassAtK(k=k, n=n).pass_at_k(scores) == pytest.approx(direct, abs=1e-12), (n, c, k)


def test_score_reports_the_mean_of_per_problem_pass_at_k(tmp_path):
    """End to end through `score` (16 samples, pass@1 and pass@10) with random numbers correct per problem."""
    from melt_eval.evaluation.tasks import SYNTHETIC_TEST
    from melt_eval import synthetic

    rows = synthetic.make_split("test", **SYNTHETIC_TEST)
    rng = random.Random(1)
    lines, expected = [], {1: [], 10: []}
    for i in range(12):
        c = rng.randint(0, 16)
        right, wrong = f"\\boxed{{{rows[i]['answer']}}}", f"\\boxed{{{int(rows[i]['answer']) + 100}}}"
        completions = [right] * c + [wrong] * (16 - c)
        rng.shuffle(completions)
        lines.append({"index": i, "completions": completions})
        for k in expected:
            expected[k].append(1 - comb(16 - c, k) / comb(16, k))
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    metrics = score_completions("synthetic", path)["metrics"]
    for k, values in expected.items():
        assert metrics[f"pass@{k}"]["value"] == pytest.approx(sum(values) / len(values))


def test_synthetic_lookup_task_scores_the_lookup_chains(tmp_path):
    """`synthetic-lookup` evaluates the look-up chains (issue 39), not the demo's digit sums: its rows are
    the form's test split, and a worked solution from that split scores 1, its answer off by one 0."""
    from melt_eval.evaluation.data import load_rows
    from melt_eval.evaluation.tasks import SPECS, SYNTHETIC_TESTS
    from melt_eval import synthetic

    rows = load_rows(SPECS["synthetic-lookup"], None, 6)
    expected = synthetic.make_split("test", **SYNTHETIC_TESTS["synthetic-lookup"])[:6]
    assert [r["problem"] for r in rows] == [r["problem"] for r in expected] and " p p " in rows[0]["problem"]
    assert not {r["problem"] for r in rows} & {r["problem"] for r in load_rows(SPECS["synthetic"], None, None)}
    lines = [{"index": i, "completions": [r["solution"]] * 3 + [f"\\boxed{{{int(r['answer']) % 5 + 1}}}"]}
             for i, r in enumerate(expected)]
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert score_completions("synthetic-lookup", path)["metrics"]["pass@1"]["value"] == pytest.approx(0.75)
