"""A deterministic synthetic reasoning task: variable tracking with small arithmetic.

One problem is a chain of assignments, each using earlier variables, and a question
about the last one; the final answer is written as \\boxed{...}:

    problem:  a = 7. b = a + 5. c = b - a. What is c?
    solution: b = 7 + 5 = 12. c = 12 - 7 = 5. The answer is \\boxed{5}.
    answer:   5

More steps need more sequential computation per token, which is where extra loops of a
LoopLM help. Used as a built-in training source (`source: synthetic` in a recipe) and by
the demo's LightEval task, so both must build prompts with `user_prompt`.

Splits are disjoint by construction: a problem belongs to "test" iff a stable hash of
its text falls in the test bucket, whatever the seed, so no test problem is ever
trained on. The same (split, n, seed, options) always gives the same list.
"""

from __future__ import annotations

import hashlib
import random

SPLITS = ("train", "test")
TEST_FRACTION = 0.1  # share of the problem space reserved for the test split
VARIABLES = "abcdefghij"


def _bucket(problem: str) -> str:
    h = int.from_bytes(hashlib.sha256(problem.encode()).digest()[:8], "big")
    return "test" if h % 1000 < TEST_FRACTION * 1000 else "train"


def make_problem(rng: random.Random, num_steps: int = 2, max_value: int = 9) -> dict:
    """One problem with `num_steps` derived variables; start value and constants in 1..max_value."""
    names = VARIABLES[: num_steps + 1]
    values = {names[0]: rng.randint(1, max_value)}
    statements, worked = [f"{names[0]} = {values[names[0]]}"], []
    for i in range(1, num_steps + 1):
        name, prev = names[i], names[i - 1]
        op = rng.choice("+-")
        # the right operand is a constant or (from the second step on) an older variable
        if i >= 2 and rng.random() < 0.5:
            other = rng.choice(names[: i - 1])
            rhs_text, rhs_value = other, values[other]
        else:
            rhs_value = rng.randint(1, max_value)
            rhs_text = str(rhs_value)
        values[name] = values[prev] + rhs_value if op == "+" else values[prev] - rhs_value
        statements.append(f"{name} = {prev} {op} {rhs_text}")
        worked.append(f"{name} = {values[prev]} {op} {rhs_value} = {values[name]}")
    last = names[num_steps]
    answer = str(values[last])
    problem = ". ".join(statements) + f". What is {last}?"
    solution = ". ".join(worked) + f". The answer is \\boxed{{{answer}}}."
    return {"problem": problem, "answer": answer, "solution": solution}


def make_split(split: str, n: int, seed: int = 0, *, num_steps: int | tuple[int, int] = 2, max_value: int = 9) -> list[dict]:
    """`n` distinct problems of `split` ("train" or "test") as {"problem", "answer", "solution"}.

    num_steps: an int, or (lo, hi) to draw each problem's step count uniformly from lo..hi.
    Raises ValueError if the split's problem space has fewer than `n` distinct problems.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    lo, hi = (num_steps, num_steps) if isinstance(num_steps, int) else tuple(num_steps)
    if lo < 1 or hi < lo or hi >= len(VARIABLES):
        raise ValueError(f"num_steps must be within 1..{len(VARIABLES) - 1}, got {num_steps!r}")
    # string seeds hash deterministically across Python runs (random.Random uses sha512 on str)
    rng = random.Random(f"melt-eval-synthetic/{split}/{seed}/{lo}-{hi}/{max_value}")
    out, seen = [], set()
    attempts = 0
    while len(out) < n:
        attempts += 1
        if attempts > 50 * n + 10_000:
            raise ValueError(f"cannot draw {n} distinct {split} problems with num_steps={num_steps}, max_value={max_value}")
        item = make_problem(rng, rng.randint(lo, hi), max_value)
        if item["problem"] in seen or _bucket(item["problem"]) != split:
            continue
        seen.add(item["problem"])
        out.append(item)
    return out


def user_prompt(problem: str) -> str:
    """The user turn for a problem: the single place training and evaluation agree on."""
    return problem


def to_messages(item: dict, target: str = "answer") -> list[dict]:
    """A chat for training: the problem, then the boxed answer ("answer") or the worked solution."""
    if target not in ("answer", "solution"):
        raise ValueError(f"target must be 'answer' or 'solution', got {target!r}")
    reply = f"\\boxed{{{item['answer']}}}" if target == "answer" else item["solution"]
    return [{"role": "user", "content": user_prompt(item["problem"])}, {"role": "assistant", "content": reply}]
