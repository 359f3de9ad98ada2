"""Humanity's Last Exam without a paid judge: a fixed text-only subset, scored by answer type.

Subset: the questions without an image, ordered by sha256 of their id, the first 300. The order
depends only on the ids, so the subset is the same on every machine and for every model.

Prompt: LightEval's (the question, with its "Explanation / Answer / Confidence" format as the
instruction). Scoring: the `Answer: ...` line. Multiple-choice questions compare the
letter; exact-match questions compare with math-verify (numbers, expressions, LaTeX) and, failing
that, the normalised strings (case, spaces and trailing punctuation ignored).
"""

from __future__ import annotations

import hashlib
import json
import re

from lighteval.tasks.requests import Doc
from lighteval.tasks.tasks.hle import hle_text_only

SUBSET_SIZE = 300
ANSWER = re.compile(r"answer\s*:\s*(.+)", re.IGNORECASE)


def select_subset(rows: list[dict]) -> list[dict]:
    text_only = [r for r in rows if not r.get("image")]
    return sorted(text_only, key=lambda r: hashlib.sha256(str(r["id"]).encode()).hexdigest())[:SUBSET_SIZE]


def hle_prompt(line: dict, task_name: str | None = None) -> Doc:
    """LightEval's HLE prompt (the question; its answer format as the instruction), with a gold that also
    carries the answer type for judge-free scoring."""
    doc = hle_text_only({**line, "image": ""}, task_name)  # the subset is text-only already
    doc.choices = [json.dumps({"answer": str(line["answer"]), "type": line.get("answer_type", "exactMatch")})]
    return doc


def final_answer(text: str) -> str | None:
    found = ANSWER.findall(text)
    return found[-1].strip() if found else None


def _norm(s: str) -> str:
    return re.sub(r"\s+", " ", s.strip().strip(".").strip("$").lower())


def hle_score(doc: Doc, model_response) -> float:
    gold = json.loads(doc.get_golds()[0])
    pred = final_answer(model_response.final_text[0])
    if pred is None:
        return 0.0
    if gold["type"] == "multipleChoice":
        letter = re.match(r"\(?([A-Za-z])\)?(?:\W|$)", pred)
        return float(bool(letter) and letter.group(1).upper() == gold["answer"].strip().upper())
    if _norm(pred) == _norm(gold["answer"]):
        return 1.0
    import math_verify

    try:
        return float(math_verify.verify(math_verify.parse(gold["answer"]), math_verify.parse(pred)))
    except Exception:  # math-verify gives up on some inputs; that is a miss, not a crash
        return 0.0
