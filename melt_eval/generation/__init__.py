"""Generation engines: the native one (LoopLM, MELT) and, with vLLM installed, vLLM's; `backends` puts
them (and OpenAI-compatible endpoints) behind one interface for a run (`make_backend`)."""

from melt_eval.generation.engine import GenerationResult, generate, sample_next

__all__ = ["GenerationResult", "generate", "sample_next"]
