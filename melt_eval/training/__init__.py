"""MELT training: recipes, data, the objective, and the Accelerate-based runner (`melt-eval train`).
The runner (torch, Accelerate) is imported on first use, so importing the package stays light."""

from importlib import import_module

_EXPORTS = {
    "Recipe": "melt_eval.training.config",
    "load_recipe": "melt_eval.training.config",
    "run_recipe": "melt_eval.training.runner",
    "train": "melt_eval.training.runner",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
