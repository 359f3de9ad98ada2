"""Generation engines: the native one (LoopLM, MELT) and, with vLLM installed, vLLM's."""

from melt_eval.generation.engine import GenerationResult, generate, sample_next

__all__ = ["GenerationResult", "generate", "sample_next"]
