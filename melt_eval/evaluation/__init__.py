"""Evaluation: LightEval tasks, the harness's LightevalModel, `run`, `score` and `tasks`.

The entry points are loaded on first use (they bring LightEval and torch), so importing a light module
of this package, such as its command module, does not pay for them.
"""

from __future__ import annotations

import importlib

__all__ = ["BackendSettings", "RunPaths", "run_tasks", "score_completions"]


def __getattr__(name: str):
    if name in __all__:
        value = getattr(importlib.import_module("melt_eval.evaluation.runner"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
