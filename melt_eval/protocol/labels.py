"""What the paper's tables print: each benchmark's label, and the paper's name of each model it compares.

Results directories use task names and registry model names; these are the paper's spellings of them
(its keys in paper_results.json), in its row and column order.
"""

from __future__ import annotations

from melt_eval.protocol.tasks import GROUPS

_LABELS = {
    "aime24": "AIME24", "aime25": "AIME25", "aime26": "AIME26", "amc23": "AMC23", "math500": "MATH-500",
    "olympiadbench": "OlympiadBench", "gpqa": "GPQA", "hle": "HLE", "mmlu_redux": "MMLU-Redux",
    "humaneval": "HumanEval",
}
# Benchmarks in the paper's row order, with the labels its tables print.
BENCHMARK_LABELS = {task: _LABELS[task] for task in GROUPS["paper"]}

# Main comparison: registry model name -> the paper's model key, in the paper's column order.
MAIN_MODELS = {
    "ouro-1.4b-thinking": "Ouro-1.4B-Thinking",
    "melt-1.6b": "MELT-1.6B",
    "qwen3-1.7b": "Qwen3-1.7B",
    "gemma4-e2b": "Gemma4-E2B",
    "qwen3.5-2b": "Qwen3.5-2B",
    "deepseek-r1-1.5b": "DeepSeek-R1-1.5B",
}
