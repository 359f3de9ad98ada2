"""The paper's numbers (a packaged copy of spec/paper_results.json) and how our names map onto them.

Results directories use registry model names and short variant names; the paper's tables use
display labels. The labels, the benchmark groups and the variants are the protocol's
(`melt_eval.protocol`); matching our names against the paper's numbers lives here.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from importlib.resources import files

from melt_eval.protocol.labels import BENCHMARK_LABELS
from melt_eval.protocol.variants import ABLATIONS as VARIANT_DEFINITIONS


@lru_cache(maxsize=1)
def paper_results() -> dict:
    return json.loads(files("melt_eval.report").joinpath("paper_results.json").read_text(encoding="utf-8"))


def norm(name: str) -> str:
    """Loose key for matching names across sources: 'Gemma-4-E2B' == 'gemma4-e2b', 'math_500' == 'math500'."""
    return re.sub(r"[^a-z0-9.]", "", name.lower())


def benchmark_metrics(benchmark: str) -> list[str]:
    return paper_results()["benchmarks"][benchmark]["metrics"]


def canonical_task(task: str) -> str | None:
    """Map a results directory's task name onto a paper benchmark key (None if it is not one)."""
    wanted = norm(task)
    for key in BENCHMARK_LABELS:
        if norm(key) == wanted:
            return key
    return None


# Ablations: variant directory name -> (key in paper_results.json, label as the paper prints it), in the
# paper's row order; each variant is defined once, in melt_eval.protocol.variants.
ABLATIONS = {
    a.name: {"section": a.section, "title": a.title, "stub": a.stub,
             "variants": {v.name: (v.paper_key, v.paper_label) for v in a.variants}}
    for a in VARIANT_DEFINITIONS.values()
}

# Runs that the paper reports twice (the same checkpoint in two tables): a variant with no results of
# its own borrows them from there, and the table says so.
ABLATION_FALLBACKS = {
    (a.name, v.name): v.fallback for a in VARIANT_DEFINITIONS.values() for v in a.variants if v.fallback
}


def paper_memory(display_or_name: str) -> dict | None:
    """The paper's memory-table row for a model (its keys carry notes such as '(commented out ...)')."""
    wanted = norm(display_or_name)
    for key, row in paper_results()["memory"].items():
        bare = key.split(" (")[0]
        if norm(bare) == wanted:
            return {**row, "paper_label": bare, "commented_out": "commented out" in key}
    return None
