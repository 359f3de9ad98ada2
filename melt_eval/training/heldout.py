"""Stop a training run by what the model has learned: recipe key `stop_at_heldout` (docs/training.md#stopping-on-held-out-accuracy).

Every `every` optimiser steps the model answers a fixed held-out split of the recipe's synthetic task with
the native engine at `loops` loops; once its pass@1 reaches `target` the run stops there and is exported as a
finished run. The split is the test bucket's problems that no built-in test task evaluates: the hash that
keeps test problems out of every training split keeps these out too (melt_eval.synthetic), and the test
task's own rows are left out by name, so training, stopping and the reported score use three disjoint sets.

    stop_at_heldout: {loops: 4, target: 0.8, every: 50, problems: 23, samples: 4}

A check depends only on the weights at its step (a fixed split, per-row seeded sampling that leaves the
training RNG alone), so a run resumed between checks redoes the same steps and stops at the same one.
"""

from __future__ import annotations

import re
import time

from melt_eval.errors import UserError

KEYS = ("loops", "target", "every", "problems", "samples")
REQUIRED = ("loops", "target", "every")
DEFAULTS = {"problems": 20, "samples": 1}
# More than any synthetic task's test bucket is worth checking against at every check; the split maker gives
# up only after 50 draws per problem asked, so a bound here is what keeps an absurd value from drawing forever
MAX_PROBLEMS = 10_000
# samples > 1 draw as the demo's evaluation does (docs/demo.md), so the check reads the score it predicts
TEMPERATURE, TOP_P, SEED = 1.0, 0.7, 0
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def check_spec(spec, recipe, bad) -> None:
    """`stop_at_heldout`'s value, before anything is built: one line naming what to change."""
    if spec is None:
        return
    example = "e.g. {loops: 4, target: 0.8, every: 50, problems: 20, samples: 4}"
    if not isinstance(spec, dict):
        bad(f"stop_at_heldout must be a mapping ({example}) or null, got {spec!r}")
    unknown = sorted(set(spec) - set(KEYS))
    missing = [k for k in REQUIRED if k not in spec]
    if unknown or missing:
        bad(f"stop_at_heldout: {'unknown key(s) ' + ', '.join(map(str, unknown)) if unknown else 'missing ' + ', '.join(missing)}; "
            f"keys: {', '.join(KEYS)} ({example})")
    for key in ("loops", "every", "problems", "samples"):
        v = spec.get(key, DEFAULTS.get(key))
        if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
            bad(f"stop_at_heldout: {key} must be a whole number >= 1, got {v!r}")
    problems = spec.get("problems", DEFAULTS["problems"])
    if problems > MAX_PROBLEMS:
        bad(f"stop_at_heldout: problems {problems} is more than a held-out split holds (at most {MAX_PROBLEMS}); "
            "lower stop_at_heldout.problems (e.g. 20), or set stop_at_heldout: null")
    target = spec["target"]
    if not (isinstance(target, (int, float)) and not isinstance(target, bool) and 0 < target <= 1):
        bad(f"stop_at_heldout: target is a pass@1 within (0, 1], got {target!r}")
    if recipe.target not in ("looplm", "melt"):
        bad(f"stop_at_heldout stops a model's training by its answers; target {recipe.target} trains only a gate: set it to null")
    if source(recipe.data) is None:
        bad("stop_at_heldout draws its held-out problems from a synthetic data source; this recipe has none")


def source(data: list) -> dict | None:
    """The recipe's first synthetic source: the task the held-out problems are drawn from."""
    return next((s for s in data if isinstance(s, dict) and s.get("source") == "synthetic"), None)


def _options(src: dict) -> dict:
    steps = src.get("num_steps", 2)
    return dict(num_steps=(steps, steps) if isinstance(steps, int) else tuple(steps), max_value=src.get("max_value", 9),
                form=src.get("form", "variables"))


def heldout_rows(src: dict, problems: int) -> list[dict]:
    """`problems` test-bucket problems of the source's task that no built-in test task evaluates: drawn after
    the test task's own rows (make_split draws in a fixed order, so those come first) and checked against them."""
    from melt_eval import synthetic
    from melt_eval.evaluation.tasks import SYNTHETIC_TESTS

    opts = _options(src)
    tests = [t for t in SYNTHETIC_TESTS.values()
             if (tuple(t["num_steps"]), t["max_value"], t["form"]) == (opts["num_steps"], opts["max_value"], opts["form"])]
    skip = max((t["n"] for t in tests if t["seed"] == 0), default=0)
    try:
        rows = synthetic.make_split("test", skip + problems, seed=0, **opts)[skip:]
    except synthetic.TooFewProblems as e:
        left = max(e.found - skip, 0)
        lower = f"lower stop_at_heldout.problems to {left} or fewer, or " if left else ""
        raise UserError(f"stop_at_heldout: the {opts['form']} task has fewer than {problems} problems beside its "
                        f"{skip} test problems ({left} found); {lower}set stop_at_heldout: null") from None
    except ValueError as e:  # the source's own settings (num_steps, form): said as the data source says them
        raise UserError(f"stop_at_heldout draws from the recipe's synthetic source, which is refused: {e}") from None
    test_problems = {r["problem"] for t in tests for r in synthetic.make_split("test", **t)}
    rows = [r for r in rows if r["problem"] not in test_problems]
    if len(rows) < problems:  # a test task drawn with another seed took some: never score on a test problem
        raise UserError(f"stop_at_heldout: only {len(rows)} held-out problems are left beside the test tasks; "
                        f"lower stop_at_heldout.problems to {len(rows)}, or set stop_at_heldout: null")
    return rows


def held_out_rows(recipe) -> list[dict] | None:
    """The run's held-out problems, or None: no stop_at_heldout, or a run that ends before its first check (a
    short test run of the recipe on another task needs no held-out problems). Drawn before the model loads, so
    a split too small for `problems` is refused in seconds."""
    spec = recipe.stop_at_heldout
    if not spec or recipe.max_steps < spec["every"]:
        return None
    return heldout_rows(source(recipe.data), {**DEFAULTS, **spec}["problems"])


def held_out_check(recipe, tokenizer, rows: list[dict] | None = None) -> "HeldoutCheck | None":
    """The run's check, or None (see `held_out_rows`); `rows`: those already drawn."""
    rows = held_out_rows(recipe) if rows is None else rows
    return None if rows is None else HeldoutCheck(recipe, tokenizer, rows)


class HeldoutCheck:
    """The recipe's stopping rule, set up once per run: the held-out prompts, tokenised as evaluation does."""

    def __init__(self, recipe, tokenizer, rows: list[dict] | None = None) -> None:
        from melt_eval import synthetic

        spec = {**DEFAULTS, **recipe.stop_at_heldout}
        self.loops, self.target, self.every = spec["loops"], float(spec["target"]), spec["every"]
        self.samples = spec["samples"]
        self.rows = heldout_rows(source(recipe.data), spec["problems"]) if rows is None else rows
        self.eos = tokenizer.eos_token_id
        chat = lambda messages, **kw: tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kw)["input_ids"]
        self.prompts = [chat([{"role": "user", "content": synthetic.user_prompt(r["problem"])}], add_generation_prompt=True)
                        for r in self.rows]
        # room for the longest gold reply and its end: an untrained model that never stops costs no more
        self.max_new_tokens = max(len(chat(synthetic.to_messages(r, "solution"))) - len(p)
                                  for r, p in zip(self.rows, self.prompts)) + 4
        # prompts prefilled as the demo evaluates (docs/method.md#prefill): whole where the recipe trains them so
        self.prefill_chunk = recipe.seq_len if recipe.prompt_as_one_chunk or not recipe.chunk_size else recipe.chunk_size
        self.decode = tokenizer.decode

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def run(self, model, step: int) -> dict:
        """pass@1 of `model` (unwrapped) on the held-out split at this step, and whether it stops the run."""
        import torch

        from melt_eval.generation.engine import generate
        from melt_eval.generation.options import InferenceOptions

        t0 = time.perf_counter()
        was_training = model.training
        model.eval()
        try:
            greedy = self.samples == 1
            with torch.no_grad():
                res = generate(model, self.prompts, InferenceOptions(loops=self.loops, prefill_chunk=self.prefill_chunk),
                               n=self.samples, temperature=0.0 if greedy else TEMPERATURE, top_p=1.0 if greedy else TOP_P,
                               max_new_tokens=self.max_new_tokens, seed=SEED, eos_token_id=self.eos)
        finally:
            model.train(was_training)
        right = sum(answer(self.decode(seq, skip_special_tokens=True)) == row["answer"]
                    for row, seqs in zip(self.rows, res.sequences) for seq in seqs)
        score = right / (len(self.rows) * self.samples)
        return {"step": step, "loops": self.loops, "pass@1": round(score, 4), "target": self.target,
                "problems": len(self.rows), "samples": self.samples, "stop": score >= self.target,
                "seconds": round(time.perf_counter() - t0, 2)}


def answer(reply: str) -> str | None:
    """The last \\boxed{} of a reply, stripped: the synthetic answers are plain integers, where this string
    match gives LightEval's math metric's verdict (the screens' check: benchmarks/demo_task_screen.py, at commit 59829de)."""
    found = _BOXED.findall(reply)
    return found[-1].strip() if found else None
