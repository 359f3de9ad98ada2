"""Model classes. Importing a class's module registers its model type ("ouro", "melt") with transformers'
Auto classes; this package imports them on first use, so importing it (a command module does) stays light."""

from importlib import import_module

_EXPORTS = {
    "GATES": "melt_eval.modeling.gates",
    "LoopLMConfig": "melt_eval.modeling.looplm",
    "LoopLMForCausalLM": "melt_eval.modeling.looplm",
    "LoopLMOutput": "melt_eval.modeling.looplm",
    "MeltConfig": "melt_eval.modeling.melt",
    "MeltForCausalLM": "melt_eval.modeling.melt",
    "load_model": "melt_eval.modeling.loading",
    "load_tokenizer": "melt_eval.modeling.loading",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
