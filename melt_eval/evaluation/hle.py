"""Humanity's Last Exam without a paid judge: a fixed text-only subset, scored by answer type.

Subset: the questions without an image, ordered by sha256 of their id, the first 300. The order
depends only on the ids, so the subset is the same on every machine and for every model.

Scoring: the model is asked to end with `Answer: ...`. Multiple-choice questions compare the
letter; exact-match questions compare with math-verify (numbers, expressions, LaTeX) and, failing
that, the normalised strings (case, spaces and trailing punctuation ignored).
"""

from __future__ import annotations

import hashlib
import json
import re

from lighteval.tasks.requests import Doc

SUBSET_SIZE = 300
ANSWER = re.compile(r"answer\s*:\s*(.+)", re.IGNORECASE)


def select_subset(rows: list[dict]) -> list[dict]:
    text_only = [r for r in rows if not r.get("image")]
    return sorted(text_only, key=lambda r: hashlib.sha256(str(r["id"]).encode()).hexdigest())[:SUBSET_SIZE]


def hle_prompt(line: dict, task_name: str | None = None) -> Doc:
    kind = line.get("answer_type", "exactMatch")
    query = (f"{line['question']}\n\nThink step by step, then give your final answer on the last line as "
             f"'Answer: {'LETTER' if kind == 'multipleChoice' else 'ANSWER'}'.")
    gold = json.dumps({"answer": str(line["answer"]), "type": kind})
    return Doc(task_name=task_name, query=query, choices=[gold], gold_index=0)


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
