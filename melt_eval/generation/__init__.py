"""Generation engines: the native one (LoopLM, MELT) and, with vLLM installed, vLLM's; `backends` puts
them (and OpenAI-compatible endpoints) behind one interface for a run (`make_backend`).

The engine's names are loaded on first use (they bring torch), so a light module of this package, such as
`options`, checks a command's flags in a second, before any weight or library loads."""

from __future__ import annotations

import importlib

__all__ = ["GenerationResult", "generate", "sample_next"]


def __getattr__(name: str):
    if name in __all__:
        value = getattr(importlib.import_module("melt_eval.generation.engine"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
