"""The paper's benchmarks as data: what each one is and how the paper evaluates it (docs/method.md#evaluation-protocol).

16 samples with pass@1 and pass@10 on AIME24/25/26 and AMC23, one sample with accuracy elsewhere, up to
32,768 new tokens; plus the demo's built-in synthetic task. A task's behaviour (its LightEval prompt,
metrics and answer extraction) is `melt_eval.evaluation.tasks`, which adds it to each entry here;
`melt-eval tasks` prints this table without loading LightEval.
"""

from __future__ import annotations

from dataclasses import dataclass

PAPER_MAX_NEW_TOKENS = 32768


@dataclass(frozen=True)
class Benchmark:
    """A task's protocol: where its rows come from, and the paper's samples, metrics and generation limit."""

    name: str
    hf_repo: str | None  # None: built in (no download)
    hf_subset: str
    split: str
    samples: int  # samples per problem (the paper's)
    kind: str  # "math" | "choice" | "code" | "judge-free": the --data-dir schema; "code" runs in the sandbox
    max_new_tokens: int = PAPER_MAX_NEW_TOKENS
    num_problems: int | None = None  # the evaluation split's size, where fixed
    note: str = ""

    @property
    def metric_names(self) -> list[str]:
        return ["pass@1", "pass@10"] if self.samples > 1 else ["accuracy"]


BENCHMARKS: dict[str, Benchmark] = {
    b.name: b
    for b in [
        Benchmark("aime24", "HuggingFaceH4/aime_2024", "default", "train", 16, "math", num_problems=30),
        Benchmark("aime25", "yentinglin/aime_2025", "default", "train", 16, "math", num_problems=30),
        Benchmark("aime26", "MathArena/aime_2026", "default", "train", 16, "math", num_problems=30,
                  note="Hub copy assumed at MathArena/aime_2026; pass --data-dir with aime26.jsonl otherwise"),
        Benchmark("amc23", "math-ai/amc23", "default", "test", 16, "math", num_problems=40),
        Benchmark("math500", "HuggingFaceH4/MATH-500", "default", "test", 1, "math", num_problems=500),
        Benchmark("olympiadbench", "Hothan/OlympiadBench", "OE_TO_maths_en_COMP", "train", 1, "math", num_problems=674,
                  note="text-only English competition math (674 rows; the paper reports 581)"),
        Benchmark("gpqa", "Idavidrein/gpqa", "gpqa_main", "train", 1, "choice", num_problems=448,
                  note="main set, options shuffled deterministically per question"),
        Benchmark("mmlu_redux", "edinburgh-dawg/mmlu-redux-2.0", "*", "test", 1, "choice", num_problems=5700,
                  note="all 57 subjects (100 each), LightEval's prompt per subject, letter extraction"),
        Benchmark("hle", "cais/hle", "default", "test", 1, "judge-free", num_problems=300,
                  note="fixed text-only subset: first 300 by sha256(id); letter / math-verify scoring, no paid judge"),
        Benchmark("humaneval", "openai/openai_humaneval", "default", "test", 1, "code", num_problems=164,
                  note="unit tests run in a sandboxed child process (no network, time/CPU/memory/output limits)"),
        Benchmark("synthetic", None, "default", "test", 16, "math", max_new_tokens=96, num_problems=100,
                  note="built in: digit-sum chains worked step by step (melt_eval.synthetic)"),
        Benchmark("synthetic-lookup", None, "default", "test", 16, "math", max_new_tokens=96, num_problems=100,
                  note="built in: look-up chains, two look-ups into the prompt's table a step (melt_eval.synthetic)"),
    ]
}

# The paper's benchmarks in its main table's row order: the math ones (its first average row), then the rest.
MATH_BENCHMARKS = ("aime24", "aime25", "aime26", "amc23", "math500", "olympiadbench")
NON_MATH_BENCHMARKS = ("gpqa", "hle", "mmlu_redux", "humaneval")
# The ablation tables' columns.
ABLATION_BENCHMARKS = ("aime24", "aime25", "amc23", "math500")

GROUPS: dict[str, list[str]] = {
    "paper": [*MATH_BENCHMARKS, *NON_MATH_BENCHMARKS],
    "math": list(MATH_BENCHMARKS),
    "ablation": list(ABLATION_BENCHMARKS),
}


def expand(names: str | list[str]) -> list[str]:
    """Task names and groups -> task names, in order, without repeats."""
    from melt_eval.errors import UserError

    items = names.split(",") if isinstance(names, str) else list(names)
    out: list[str] = []
    for item in (i.strip() for i in items):
        if not item:
            continue
        for name in GROUPS.get(item, [item]):
            if name not in BENCHMARKS:
                known = ", ".join(list(BENCHMARKS) + list(GROUPS))
                hint = " (not built yet in this version)" if name in GROUPS["paper"] else ""
                raise UserError(f"unknown task {name!r}{hint}; known tasks and groups: {known}")
            if name not in out:
                out.append(name)
    return out
