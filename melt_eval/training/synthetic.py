"""A deterministic synthetic reasoning task: repeated two-digit arithmetic, worked step by step.

One problem asks for a number after adding (or subtracting) a constant several times; the worked
solution does one addition per step, each on the previous step's result, then boxes the answer:

    problem:  Start at 47. Add 8, 5 times.
    solution: 1: 47 + 8 = 55. 2: 55 + 8 = 63. 3: 63 + 8 = 71. 4: 71 + 8 = 79. 5: 79 + 8 = 87.
              The answer is \\boxed{87}.
    answer:   87

Every number is two-digit (one token per digit in the tiny tokenizer), so each step is ten tokens.

The reply is most of the sequence (as in the paper, where the generated reasoning dominates the
KV cache): ten tokens a step against a prompt of 19 with its chat template, so 5 or more
steps generate over three times the prompt. Every step still needs a computation the model makes
inside its loops (a two-digit sum or difference, with carries), and every step reads the previous
step's result from the generated text, so a model whose cache of generated tokens is wrong (the
untrained KV-sharing baselines) loses the chain. Used as a built-in training source (`source:
synthetic` in a recipe, `target: solution` for the worked steps) and by the demo's LightEval task,
so both must build prompts with `user_prompt`.

Splits are disjoint by construction: a problem belongs to "test" iff a stable hash of its text
falls in the test bucket, whatever the seed, so no test problem is ever trained on. The same
(split, n, seed, options) always gives the same list.
"""

from __future__ import annotations

import hashlib
import random

SPLITS = ("train", "test")
TEST_FRACTION = 0.1  # share of the problem space reserved for the test split
MAX_STEPS = 9  # step indices stay one token
START = (10, 99)  # every value of a problem stays in this range


def _bucket(problem: str) -> str:
    h = int.from_bytes(hashlib.sha256(problem.encode()).digest()[:8], "big")
    return "test" if h % 1000 < TEST_FRACTION * 1000 else "train"


def make_problem(rng: random.Random, num_steps: int = 5, max_value: int = 9) -> dict:
    """One problem of `num_steps` additions or subtractions of a constant in 2..max_value.

    Every value on the way is two-digit, so every step is the same number of tokens (the model finds
    the previous result at a fixed distance) and only the step's own arithmetic varies."""
    step = rng.randint(2, max_value)
    op = rng.choice("+-")
    span = step * num_steps
    if span > START[1] - START[0]:
        raise ValueError(f"{num_steps} steps of {step} leave the two-digit range")
    start = rng.randint(START[0], START[1] - span) if op == "+" else rng.randint(START[0] + span, START[1])
    value, worked = start, []
    for i in range(1, num_steps + 1):
        new = value + step if op == "+" else value - step
        worked.append(f"{i}: {value} {op} {step} = {new}.")
        value = new
    verb = "Add" if op == "+" else "Subtract"
    problem = f"Start at {start}. {verb} {step}, {num_steps} times."
    solution = " ".join(worked) + f" The answer is \\boxed{{{value}}}."
    return {"problem": problem, "answer": str(value), "solution": solution}


def make_split(split: str, n: int, seed: int = 0, *, num_steps: int | tuple[int, int] = 5,
               max_value: int = 9) -> list[dict]:
    """`n` distinct problems of `split` ("train" or "test") as {"problem", "answer", "solution"}.

    num_steps: an int, or (lo, hi) to draw each problem's step count uniformly from lo..hi.
    Raises ValueError if the split's problem space has fewer than `n` distinct problems.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    lo, hi = (num_steps, num_steps) if isinstance(num_steps, int) else tuple(num_steps)
    if lo < 1 or hi < lo or hi > MAX_STEPS:
        raise ValueError(f"num_steps must be within 1..{MAX_STEPS}, got {num_steps!r}")
    if max_value < 2:
        raise ValueError(f"max_value must be at least 2, got {max_value!r}")
    if max_value * hi > START[1] - START[0]:
        raise ValueError(f"{hi} steps of up to {max_value} leave the two-digit range: lower num_steps or max_value")
    # the whole space (start x step x op x count), so an impossible n fails at once, not after a search
    space = sum(2 * (START[1] - START[0] + 1 - k * c) for k in range(2, max_value + 1) for c in range(lo, hi + 1))
    if n > space * (TEST_FRACTION if split == "test" else 1 - TEST_FRACTION) * 0.95:
        raise ValueError(f"cannot draw {n} distinct {split} problems with num_steps={num_steps}, max_value={max_value}: "
                         f"the split holds about {int(space * (TEST_FRACTION if split == 'test' else 1 - TEST_FRACTION))}")
    # string seeds hash deterministically across Python runs (random.Random uses sha512 on str)
    rng = random.Random(f"melt-eval-synthetic-v2/{split}/{seed}/{lo}-{hi}/{max_value}")
    out, seen = [], set()
    while len(out) < n:
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
    """A chat for training: the problem, then the boxed answer alone ("answer") or the worked solution."""
    if target not in ("answer", "solution"):
        raise ValueError(f"target must be 'answer' or 'solution', got {target!r}")
    reply = f"\\boxed{{{item['answer']}}}" if target == "answer" else item["solution"]
    return [{"role": "user", "content": user_prompt(item["problem"])}, {"role": "assistant", "content": reply}]
