"""The paper's benchmarks as LightEval tasks, plus the demo's synthetic task.

Each task is one `TaskSpec` in `SPECS`: its protocol (`melt_eval.protocol.tasks`: source, samples,
problems, limits) with its behaviour as data, as LightEval's `LightevalTaskConfig` does: its prompt
function, its metrics (a function of the sample count) and how an answer is read from a completion
(for the per-problem details). A new task is one entry there and one here; `task_config` turns it into
LightEval's config, `lighteval_cli_table` into the table LightEval's own CLI loads (`tasks/melt_tasks.py`).

Prompts and answer extraction are LightEval's own (its AIME and MATH-500 templates, its
math-verify based `pass@k` metric, its letter-extraction for multiple choice); the
protocol is the paper's (docs/method.md#evaluation-protocol): 16 samples with pass@1 and pass@10 on
AIME24/25/26 and AMC23, one sample with accuracy elsewhere, up to 32,768 new tokens.

Every task reads either the Hub dataset or a local file `DIR/<task>.jsonl|.parquet`
(`--data-dir`) in the Hub's schema or in the `{problem, answer}` schema; `normalise`
maps any of them onto the fields the prompt functions read.
"""

from __future__ import annotations

import hashlib
import math
import numbers
import random
from dataclasses import asdict, dataclass, field
from typing import Callable

import numpy as np
from lighteval.metrics.metrics import Metrics
from lighteval.metrics.metrics_sample import PassAtK
from lighteval.metrics.utils.extractive_match_utils import extract_target_from_pred, get_extraction_regexes
from lighteval.metrics.utils.metric_utils import SampleLevelMetric
from lighteval.tasks.lighteval_task import LightevalTaskConfig
from lighteval.tasks.requests import Doc, SamplingMethod
from lighteval.tasks.tasks.aime import MATH_PROMPT_TEMPLATE
from lighteval.tasks.tasks.gpqa import gpqa_instruct_prompt
from lighteval.tasks.tasks.math_500 import MATH_QUERY_TEMPLATE
from lighteval.tasks.tasks.mmlu_redux import _MMLU_REDUX_2_SUBSETS as MMLU_REDUX_SUBJECTS
from lighteval.tasks.tasks.mmlu_redux import mmlu_redux_2_prompt

from melt_eval.evaluation.code import extract_code, humaneval_prompt, humaneval_score
from melt_eval.evaluation.hle import final_answer, hle_prompt, hle_score, select_subset
from melt_eval import synthetic
from melt_eval.protocol.tasks import BENCHMARKS, Benchmark


@dataclass(frozen=True)
class TaskSpec(Benchmark):
    """A task: its protocol (where its rows come from, the paper's samples, metrics and limits) and its
    behaviour (prompt, metrics, answer)."""

    prompt: Callable = field(kw_only=True, compare=False)  # (row, task name) -> LightEval Doc
    metrics: Callable = field(kw_only=True, compare=False)  # samples n -> LightEval metrics (the first scores details)
    extract: Callable = field(kw_only=True, compare=False)  # (doc, completion, scorer) -> what the metric read
    select: object = field(default=None, compare=False)  # rows -> the evaluated rows (a fixed subset)
    hub_filter: object = field(default=None, compare=False)  # rows LightEval's own loader keeps (its CLI only)


# ---------------------------------------------------------------- rows -> Docs


def _first(line: dict, *keys: str):
    for key in keys:
        if line.get(key) not in (None, ""):
            return line[key]
    raise KeyError(f"none of the fields {keys} in row with fields {sorted(line)}")


def normalise(line: dict) -> dict:
    """{problem, answer} from the Hub schemas of the math benchmarks or the local schema."""
    answer = _first(line, "answer", "final_answer", "expected_answer")
    if isinstance(answer, list):  # OlympiadBench: a list of final answers, each in $...$
        answer = ", ".join(_scalar(a, "an answer in the list").strip().strip("$").strip() for a in answer)
    problem = _first(line, "problem", "question", "Question")
    if not isinstance(problem, str):  # a list or a dict would be stringified into the prompt
        raise TypeError(f"the problem is a {type(problem).__name__}, not text")
    return {"problem": problem, "answer": _scalar(answer, "the answer").strip()}


def _scalar(value, what: str) -> str:
    """An answer's text: a string or a finite number (JSON's NaN would become the gold \\boxed{nan})."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what} is a {type(value).__name__}, not text or a number")
    if not math.isfinite(value):
        raise ValueError(f"{what} is {value}, not a finite number")
    return str(value)


def boxed_gold(answer: str) -> str:
    """A final answer as LightEval's math metric reads golds: LaTeX in a box.

    LightEval's own MATH-500 task passes the whole worked solution (which ends in a box); the
    `{problem, answer}` schema has only the answer, and a bare `\\frac34` or `1,3,5` is not read as
    LaTeX, so it is boxed here (without any `$` it already had)."""
    text = answer.strip().rstrip(".").strip()
    while len(text) > 1 and text.startswith("$") and text.endswith("$"):
        text = text[1:-1].strip()
    return f"$\\boxed{{{text}}}$"


def _math_prompt(template: str):
    def prompt(line: dict, task_name: str | None = None) -> Doc:
        row = normalise(line)
        return Doc(task_name=task_name, query=template.format(prompt=row["problem"]), choices=[boxed_gold(row["answer"])],
                   gold_index=0)

    return prompt


def synthetic_prompt(line: dict, task_name: str | None = None) -> Doc:
    # the exact user turn the demo's models were trained on
    return Doc(task_name=task_name, query=synthetic.user_prompt(line["problem"]), choices=[line["answer"]], gold_index=0)


def _question_seed(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


def gpqa_prompt(line: dict, task_name: str | None = None) -> Doc:
    """LightEval's GPQA instruct prompt; it places the gold option with `random`, which is seeded here by
    the question text, so every run (and every model) sees the same option order."""
    state = random.getstate()
    random.seed(_question_seed(line["Question"]))
    try:
        return gpqa_instruct_prompt(line, task_name)
    finally:
        random.setstate(state)


def mmlu_redux_prompt(line: dict, task_name: str | None = None) -> Doc:
    """LightEval's MMLU-Redux 2.0 prompt for the row's subject (the Hub loader records it; a local file
    may carry `subject`), scored with LightEval's letter extraction as its generative variant is."""
    topic = str(line.get("subject") or "general knowledge")
    if not isinstance(line["choices"], (list, tuple)) or len(line["choices"]) < 2:
        raise ValueError("choices must be a list of options")
    return mmlu_redux_2_prompt(topic)(dict(line), task_name)


def _text_only(row: dict) -> bool:
    return not row.get("image")


# ---------------------------------------------------------------- metrics


def scored_metric(prefix: str, score, n: int = 1) -> SampleLevelMetric:
    """Accuracy: LightEval's pass@1 over `n` samples around a per-completion scorer `score(doc, response)`."""
    return SampleLevelMetric(
        metric_name=f"{prefix}_pass@k:k=1&n={n}",
        sample_level_fn=PassAtK(k=1, n=n, sample_scoring_function=score),
        category=SamplingMethod.GENERATIVE,
        corpus_level_fn=np.mean,
        higher_is_better=True,
    )


def math_pass_at_k(n: int) -> list:
    """pass@1 and pass@10 (where n allows) with LightEval's math-verify scorer."""
    return [Metrics.pass_at_k_math(sample_params={"k": k, "n": n}) for k in (1, 10) if k <= n]


def math_accuracy(n: int) -> list:
    """One-sample tasks: accuracy (the mean over samples where more are asked for)."""
    return [Metrics.pass_at_k_math(sample_params={"k": 1, "n": n})]


def gpqa_accuracy(n: int) -> list:
    return [Metrics.gpqa_instruct_pass_at_k(sample_params={"k": 1, "n": n})]


def letter_accuracy(n: int) -> list:
    return [Metrics.pass_at_k_letters(sample_params={"k": 1, "n": n})]


def humaneval_accuracy(n: int) -> list:
    return [scored_metric("humaneval", humaneval_score, n)]


def hle_accuracy(n: int) -> list:
    return [scored_metric("hle", hle_score, n)]


# ---------------------------------------------------------------- what a metric read from a completion


def lighteval_answer(doc: Doc, text: str, scorer) -> str | None:
    """LightEval's own extraction (an answer or a letter), as its extractive-match scorer ran it."""
    matcher = scorer.compute_score.__self__  # LightEval's MultilingualExtractiveMatchMetric
    regexes = get_extraction_regexes(doc, matcher.pred_extraction_target, matcher.language)
    found = extract_target_from_pred(scorer.preprocess(text), regexes, matcher.fallback_mode, matcher.extraction_mode,
                                     matcher.timeout_seconds)
    return str(found[-1]) if found else None


def code_answer(doc: Doc, text: str, scorer) -> str:
    """The code HumanEval's unit tests ran."""
    return extract_code(text)


def final_answer_line(doc: Doc, text: str, scorer) -> str | None:
    """HLE's final "Answer:" line."""
    return final_answer(text)


# ---------------------------------------------------------------- the table

MATH = dict(prompt=_math_prompt(MATH_PROMPT_TEMPLATE), metrics=math_pass_at_k, extract=lighteval_answer)

# Each benchmark's behaviour; its protocol is melt_eval.protocol.tasks.BENCHMARKS.
BEHAVIOUR: dict[str, dict] = {
    "aime24": MATH,
    "aime25": MATH,
    "aime26": MATH,
    "amc23": MATH,
    "math500": dict(prompt=_math_prompt(MATH_QUERY_TEMPLATE), metrics=math_accuracy, extract=lighteval_answer),
    "olympiadbench": dict(prompt=MATH["prompt"], metrics=math_accuracy, extract=lighteval_answer),
    "gpqa": dict(prompt=gpqa_prompt, metrics=gpqa_accuracy, extract=lighteval_answer),
    "mmlu_redux": dict(prompt=mmlu_redux_prompt, metrics=letter_accuracy, extract=lighteval_answer),
    "hle": dict(prompt=hle_prompt, metrics=hle_accuracy, extract=final_answer_line, select=select_subset,
                hub_filter=_text_only),
    "humaneval": dict(prompt=humaneval_prompt, metrics=humaneval_accuracy, extract=code_answer),
    "synthetic": dict(prompt=synthetic_prompt, metrics=math_pass_at_k, extract=lighteval_answer),
    "synthetic-lookup": dict(prompt=synthetic_prompt, metrics=math_pass_at_k, extract=lighteval_answer),
}

SPECS: dict[str, TaskSpec] = {name: TaskSpec(**asdict(b), **BEHAVIOUR[name]) for name, b in BENCHMARKS.items()}

# The distribution the demo trains on: the reply (a worked step per line, at most 82 tokens with the
# chat template's end) is 3.2-4.3x its prompt, so generated tokens dominate the cache as in the paper.
SYNTHETIC_TEST = dict(n=100, seed=0, num_steps=(5, 7), max_value=9, form="digit-sum")
# The look-up chains (issue 39: a task whose steps one loop cannot do; not yet learned by the demo's
# teacher recipe, docs/results/2026-11-26-demo-task-choice.md): a recipe trains them with `form: lookup,
# max_value: 9, num_steps: [5, 7]`. Each built-in task's rows:
SYNTHETIC_TESTS = {"synthetic": SYNTHETIC_TEST,
                   "synthetic-lookup": dict(n=100, seed=0, num_steps=(5, 7), max_value=9, form="lookup")}


def metric_name(lighteval_name: str, spec: TaskSpec) -> str:
    """LightEval's metric key -> the harness's (results.json, tables): accuracy or pass@k."""
    if spec.samples == 1:
        return "accuracy"
    params = dict(kv.split("=") for kv in lighteval_name.split(":", 1)[1].split("&")) if ":" in lighteval_name else {}
    return f"pass@{params['k']}" if "k" in params else lighteval_name


def row_id(line: dict):
    """A dataset's own problem id, where it has one."""
    return next((line[k] for k in ("id", "task_id", "ID") if line.get(k) is not None), None)


def _with_position(prompt):
    """Keep the row's position (and id, where the dataset has one) on the Doc, for details and `score`."""

    def wrapped(line: dict, task_name: str | None = None) -> Doc:
        doc = prompt(line, task_name)
        doc.specific = {"index": line.get("_position"), "id": row_id(line)}
        return doc

    return wrapped


def task_config(spec: TaskSpec, samples: int | None = None, *, name: str | None = None, hf_subset: str | None = None,
                hf_filter=None) -> LightevalTaskConfig:
    return LightevalTaskConfig(
        name=name or spec.name,
        prompt_function=_with_position(spec.prompt),
        hf_repo=spec.hf_repo or "melt-eval/builtin",
        hf_subset=hf_subset or spec.hf_subset,
        hf_filter=hf_filter,
        hf_avail_splits=[spec.split],
        evaluation_splits=[spec.split],
        few_shots_split=None,
        few_shots_select=None,
        generation_size=spec.max_new_tokens,
        metrics=spec.metrics(samples or spec.samples),  # the paper's sample count unless told
        version=1,
    )


def _with_subject(prompt, subject: str):
    return lambda line, task_name=None: prompt({**line, "subject": subject}, task_name)


def lighteval_cli_table() -> list[LightevalTaskConfig]:
    """The tasks for LightEval's own CLI (`--custom-tasks tasks/melt_tasks.py --tasks melt_aime24`).

    Names carry a `melt_` prefix because LightEval refuses custom tasks named like its built-in
    ones (aime24, aime25, ...). LightEval loads the Hub datasets itself here, so: MMLU-Redux is one
    task per subject (`melt_mmlu_redux` runs all 57), HLE is every text-only question (the fixed
    300-question subset is applied by `melt-eval run`, which loads the rows itself), and the
    built-in synthetic task is left out (it is not on the Hub).
    """
    table = []
    for spec in SPECS.values():
        if spec.hf_repo is None:
            continue
        if spec.hf_subset == "*":
            for subject in MMLU_REDUX_SUBJECTS:
                config = task_config(spec, name=f"melt_{spec.name}:{subject}", hf_subset=subject)
                config.prompt_function = _with_subject(config.prompt_function, subject)
                table.append(config)
        else:
            table.append(task_config(spec, name=f"melt_{spec.name}", hf_filter=spec.hub_filter))
    return table
