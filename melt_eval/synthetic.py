"""Deterministic synthetic reasoning tasks, in seven forms; every answer is written as \\boxed{...}.

form "digit-sum" (`make_digit_sum_problem`), the demo's task: a chain of one-token digits 1..9, the
same constant added at each step and the digit sum kept, worked one numbered step per line. The reply
is 3.2-4.3x the prompt with the tiny tokenizer's chat template, so generated tokens dominate the KV
cache as the paper's long reasoning does, and each step computes on the previous step's result:

    problem:  y = 7. 6 step y + 4 sum.
    solution: 1: y = 7 + 4 = 2. 2: y = 2 + 4 = 6. ... 6: y = 9 + 4 = 4. The answer is \\boxed{4}.

forms "digit-sum2" and "digit-sum3": the same chains adding two or three constants a step
(`1: y = 7 + 6 + 4 = 8.`), so each step is a sum of three or four digits (issue 39; screened in
docs/results/2026-11-26-demo-task-choice.md, "Second screen").

form "variables" (`make_problem`, the default of `make_split`): a chain of assignments and a question
about the last one, answered with the boxed answer alone:

    problem:  a = 7. b = a + 5. c = b - a. What is c?
    solution: b = 7 + 5 = 12. c = 12 - 7 = 5. The answer is \\boxed{5}.

form "digits" (`make_digit_problem`): a last-digit chain like "digit-sum", with + or - modulo 10
(` 0` is two tokens, so steps differ in length; measured harder to learn than "digit-sum").

forms "lookup" and "lookup2" (`make_lookup_problem`): a chain through look-up tables given in the prompt,
two look-ups a step and only their result written (y -> p(p(y)), or f(p(y)) with two tables), so that one
loop of the tiny model's two layers cannot do a step (issue 39; measured in
docs/results/2026-11-26-demo-task-choice.md: not yet learned by the demo's teacher recipe). At most
max_value - 2 steps; the tables make the prompt longer: at max_value 9 the reply is 1.3-1.7x it.

    problem:  p = 4 5, 5 1, 2 4, 3 2, 1 3. b = 1. 3 step b = p p b.
    solution: 1: b = p p 1 = 2. 2: b = p p 2 = 5. 3: b = p p 5 = 3. The answer is \\boxed{3}.

Used as a built-in training source (`source: synthetic` in a recipe) and by
the demo's LightEval task, so both must build prompts with `user_prompt`.

Splits are disjoint by construction: a problem belongs to "test" iff a stable hash of
its text falls in the test bucket, whatever the seed, so no test problem is ever
trained on. The same (split, n, seed, options) always gives the same list.
"""

from __future__ import annotations

import hashlib
import random
import re

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


def make_digit_problem(rng: random.Random, num_steps: int = 6, max_value: int = 9) -> dict:
    """One last-digit chain: a start digit, then `num_steps` times the same + or - of a constant in
    1..max_value, keeping the last digit (arithmetic modulo 10), worked one numbered step per line."""
    start, step, op = rng.randint(0, 9), rng.randint(1, max_value), rng.choice("+-")
    value, worked = start, []
    for i in range(1, num_steps + 1):
        new = (value + step if op == "+" else value - step) % 10
        worked.append(f"{i}: x = {value} {op} {step} = {new}.")
        value = new
    problem = f"x = {start}. {num_steps} step each x = x {op} {step} remainder 10."
    solution = " ".join(worked) + f" The answer is \\boxed{{{value}}}."
    return {"problem": problem, "answer": str(value), "solution": solution}


DIGIT_SUM_NAMES = "xyzabc"  # names only vary the text, so the problem space is large enough for a test split


def digit_sum(a: int, b: int) -> int:
    """The digit sum of a + b for a digit a in 1..9 and b >= 1: one digit 1..9."""
    return (a + b - 1) % 9 + 1


def make_digit_sum_problem(rng: random.Random, num_steps: int = 5, max_value: int = 8, constants: int = 1) -> dict:
    """One digit-sum chain: a start in 1..9, then `num_steps` times adding the same `constants` constants,
    each in 1..min(max_value, 8), and keeping the digit sum (the sum modulo 9, 9 for 0), so every value is
    one digit 1..9, each one token of the tiny tokenizer (` 0` is two), and every step has the same length:

        problem:  y = 2. 6 step y + 8 sum.
        solution: 1: y = 2 + 8 = 1. 2: y = 1 + 8 = 9. ... The answer is \\boxed{6}.

    One operator over 1..9 leaves 72 distinct sums to learn (form "digits" has 180, a tenth with ` 0`).
    With two or three constants (forms "digit-sum2", "digit-sum3", issue 39) a step adds them all at once,
    `1: y = 2 + 8 + 4 + 5 = 1.`: two or three additions in sequence at one position, more than one loop of
    the tiny model's two layers does one after another. Constants summing to a multiple of 9 would leave
    the value unchanged (the answer the start), so they are not drawn."""
    name, start = rng.choice(DIGIT_SUM_NAMES), rng.randint(1, 9)
    while True:
        steps = [rng.randint(1, min(max_value, 8)) for _ in range(constants)]
        if sum(steps) % 9:
            break
    added = "".join(f" + {c}" for c in steps)
    value, worked = start, []
    for i in range(1, num_steps + 1):
        new = digit_sum(value, sum(steps))
        worked.append(f"{i}: {name} = {value}{added} = {new}.")
        value = new
    problem = f"{name} = {start}. {num_steps} step {name}{added} sum."  # short, so the reply dominates
    solution = " ".join(worked) + f" The answer is \\boxed{{{value}}}."
    return {"problem": problem, "answer": str(value), "solution": solution}


def _make_digit_sum2_problem(rng: random.Random, num_steps: int = 5, max_value: int = 8) -> dict:
    return make_digit_sum_problem(rng, num_steps, max_value, constants=2)


def _make_digit_sum3_problem(rng: random.Random, num_steps: int = 5, max_value: int = 8) -> dict:
    return make_digit_sum_problem(rng, num_steps, max_value, constants=3)


# A digit-sum reply read back, in the generator's own words (the f-strings above).
_DIGIT_SUM_PROBLEM = re.compile(r"(\w) = (\d+)\. (\d+) step \w((?: \+ \d+)+) sum\.")
_DIGIT_SUM_STEP = re.compile(r"\s*(\d+): (\w) = (\d+)((?: \+ \d+)+) = (\d+)\.")
_DIGIT_SUM_ANSWER = re.compile(r"\s*The answer is \\boxed\{([^{}]*)\}")

# The kinds of `first_mistake`, in the order a reply can make them.
MISTAKES = {
    "format": "not the worked form (a step numbered wrong, or text that is no step)",
    "copy": "a step names the wrong variable, starts from the wrong value (not the previous result) or adds "
            "the wrong constant",
    "sum": "a step's digit sum is wrong",
    "steps": "too few or too many steps",
    "answer": "every step right, the boxed answer not the last result",
}


def _added(text: str) -> list[int]:
    return [int(c) for c in text.split(" + ")[1:]]  # " + 4 + 5" -> [4, 5]


def first_mistake(item: dict, reply: str) -> tuple[int, str] | None:
    """Where a digit-sum reply first departs from the worked solution: (step, kind), step counted from 1
    (the boxed answer is step num_steps + 1), kind one of `MISTAKES`; None if every step and the answer
    are right. Judged on the reply's own chain: a step is checked against the reply's previous result,
    so one wrong sum is one mistake, not a cascade."""
    problem = _DIGIT_SUM_PROBLEM.fullmatch(item["problem"])
    if problem is None:
        raise ValueError(f"not a digit-sum problem: {item['problem']!r}")
    name, value, num_steps, step = problem[1], int(problem[2]), int(problem[3]), _added(problem[4])
    pos, done = 0, 0
    while (m := _DIGIT_SUM_STEP.match(reply, pos)) is not None:
        i = done + 1
        if int(m[1]) != i:
            return i, "format"
        if i > num_steps:
            return i, "steps"
        x, y, z = int(m[3]), _added(m[4]), int(m[5])
        if m[2] != name or x != value or y != step:
            return i, "copy"
        if z != digit_sum(x, sum(y)):
            return i, "sum"
        value, pos, done = z, m.end(), i
    answer = _DIGIT_SUM_ANSWER.match(reply, pos)
    if answer is None:
        return done + 1, "format"
    if done != num_steps:
        return done + 1, "steps"
    return None if answer[1].strip() == str(value) else (done + 1, "answer")


LOOKUP_NAMES = "xyzabc"  # the chain's variable; one token each, none a table's name


def make_lookup_problem(rng: random.Random, num_steps: int = 6, max_value: int = 9, tables: str = "pp") -> dict:
    """One look-up chain: the tables of `tables` in the prompt (permutations of 1..max_value, entries in
    random order), a start value, then `num_steps` steps, each applying the tables right to left ("pp":
    y -> p(p(y)); "fp": y -> f(p(y)), two tables) without writing the value in between:

        problem:  p = 4 5, 5 1, 2 4, 3 2, 1 3. b = 1. 3 step b = p p b.
        solution: 1: b = p p 1 = 2. 2: b = p p 2 = 5. 3: b = p p 5 = 3. The answer is \\boxed{3}.

    Each look-up finds a key in the prompt by its content and reads the value beside it (two attention
    layers, as an induction head), so a step's two look-ups need more layers than one loop of the tiny
    model's two. Every value is a digit 1..max_value, one token of the tiny tokenizer, and every step
    is 10 tokens. At most max_value - 2 steps, so the chain never comes back to a value it has seen."""
    n = max_value
    if not 3 <= n <= 9 or (tables == "pp" and n % 2 == 0):
        raise ValueError(f"max_value must be within 3..9 (odd for one table applied twice), got {max_value}")
    if num_steps > n - 2:
        # a chain of n steps comes back to its start and one of n - 1 ends on the one value not yet seen:
        # both answerable without a look-up (measured: a teacher trained on n = 5 with 5-7 steps boxed the
        # start on every 5-step chain and guessed the rest, docs/results/2026-11-26-demo-task-choice.md)
        raise ValueError(f"num_steps must be at most max_value - 2 = {n - 2} for a look-up chain, got {num_steps}")
    # the step's map is one cycle through all n values, so no chain falls into a fixed point or a short
    # loop that could be copied from its own earlier steps
    order = list(range(1, n + 1))
    rng.shuffle(order)
    step_map = {order[i]: order[(i + 1) % n] for i in range(n)}
    if tables == "pp":  # p = step_map^((n+1)/2), so p(p(y)) = step_map(y) (n odd)
        maps = {"p": {y: _power(step_map, (n + 1) // 2, y) for y in order}}
    elif len(tables) == 2 and tables[0] != tables[1]:  # a random inner table, the outer one made to fit
        inner = order[:]
        rng.shuffle(inner)
        inner_map = dict(zip(range(1, n + 1), inner))
        maps = {tables[1]: inner_map, tables[0]: {inner_map[y]: step_map[y] for y in range(1, n + 1)}}
    else:
        raise ValueError(f"tables must be 'pp' or two distinct names, got {tables!r}")
    perms = {}
    for t in tables[::-1] if len(set(tables)) > 1 else tables[:1]:  # the inner table first, as it is applied
        keys = list(range(1, n + 1))
        rng.shuffle(keys)  # entries in random order: a look-up must match the key, not count positions
        perms[t] = {k: maps[t][k] for k in keys}
    name, start = rng.choice(LOOKUP_NAMES), rng.randint(1, max_value)
    value, worked = start, []
    for i in range(1, num_steps + 1):
        new = value
        for t in reversed(tables):
            new = perms[t][new]
        worked.append(f"{i}: {name} = {' '.join(tables)} {value} = {new}.")
        value = new
    defs = ". ".join(f"{t} = " + ", ".join(f"{k} {v}" for k, v in p.items()) for t, p in perms.items())
    problem = f"{defs}. {name} = {start}. {num_steps} step {name} = {' '.join(tables)} {name}."
    solution = " ".join(worked) + f" The answer is \\boxed{{{value}}}."
    return {"problem": problem, "answer": str(value), "solution": solution}


def _power(step_map: dict[int, int], k: int, y: int) -> int:
    for _ in range(k):
        y = step_map[y]
    return y


def _make_lookup2_problem(rng: random.Random, num_steps: int = 6, max_value: int = 9) -> dict:
    return make_lookup_problem(rng, num_steps, max_value, tables="fp")


_LOOKUP_TABLE = re.compile(r"(\w) = ((?:\d \d, )*\d \d)")


def lookup_tables(problem: str) -> dict[str, dict[int, int]]:
    """The tables of a look-up problem's text, {name: {key: value}}."""
    return {m[1]: {int(e[0]): int(e[2]) for e in m[2].split(", ")} for m in _LOOKUP_TABLE.finditer(problem)}


FORMS = {"variables": (make_problem, len(VARIABLES) - 1), "digits": (make_digit_problem, 9),
         "digit-sum": (make_digit_sum_problem, 9),
         "digit-sum2": (_make_digit_sum2_problem, 9), "digit-sum3": (_make_digit_sum3_problem, 9), "lookup": (make_lookup_problem, 9),
         "lookup2": (_make_lookup2_problem, 9)}


class TooFewProblems(ValueError):
    """A split's problem space holds fewer distinct problems than were asked for; `found` is how many it gave."""

    def __init__(self, message: str, found: int):
        super().__init__(message)
        self.found = found


def make_split(split: str, n: int, seed: int = 0, *, num_steps: int | tuple[int, int] = 2, max_value: int = 9,
               form: str = "variables") -> list[dict]:
    """`n` distinct problems of `split` ("train" or "test") as {"problem", "answer", "solution"}.

    num_steps: an int, or (lo, hi) to draw each problem's step count uniformly from lo..hi.
    form: "variables" (variable tracking, `make_problem`), "digits" (a last-digit chain, `make_digit_problem`)
    or "digit-sum" (a chain of one-token digits, `make_digit_sum_problem`).
    Raises TooFewProblems (a ValueError) if the split's problem space has fewer than `n` distinct problems.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if form not in FORMS:
        raise ValueError(f"form must be one of {', '.join(FORMS)}, got {form!r}")
    make, most_steps = FORMS[form]
    lo, hi = (num_steps, num_steps) if isinstance(num_steps, int) else tuple(num_steps)
    if lo < 1 or hi < lo or hi > most_steps:
        raise ValueError(f"num_steps must be within 1..{most_steps}, got {num_steps!r}")
    # string seeds hash deterministically across Python runs (random.Random uses sha512 on str)
    tag = "" if form == "variables" else f"{form}/"  # the variables form keeps its original draws
    rng = random.Random(f"melt-eval-synthetic/{tag}{split}/{seed}/{lo}-{hi}/{max_value}")
    out, seen = [], set()
    attempts = 0
    while len(out) < n:
        attempts += 1
        if attempts > 50 * n + 10_000:
            raise TooFewProblems(f"cannot draw {n} distinct {split} problems with num_steps={num_steps}, "
                                 f"max_value={max_value} (found {len(out)})", len(out))
        item = make(rng, rng.randint(lo, hi), max_value)
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
