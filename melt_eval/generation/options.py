"""`InferenceOptions`: how a model generates (loops, KV sharing, prompt chunk, sampling), checked once.

The CLI builds one (`melt-eval run` flags), `run_tasks` resolves the per-task sampling defaults
(`for_task`), and the LightEval model and the generation backends (native engine, vLLM) read it
whole. Every check of these values lives here; a wrong value is a one-line UserError naming the
flag and the values it takes. The values `kv_sharing` takes are the cache policies the LoopLM
model implements (`melt_eval.modeling.looplm.KV_SHARING`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from melt_eval.errors import UserError
from melt_eval.modeling.looplm import KV_SHARING


def check_kv_sharing(value, flag: str = "--kv-sharing") -> None:
    """The one check of a kv_sharing value: None (Ouro's per-loop cache) or a loop whose KV all loops share."""
    if value not in KV_SHARING:
        named = " or ".join(repr(v) for v in KV_SHARING if v is not None)
        raise UserError(f"{flag} must be {named}, got {value!r}")


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class Sampling:
    """Samples per problem and how each is drawn. `samples`/`max_new_tokens` None: the task's own
    (the paper's protocol); `seed` is the run's, from which every problem's seed is derived."""

    samples: int | None = None
    temperature: float = 1.0
    top_p: float = 0.7
    max_new_tokens: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.samples is not None and (not _whole(self.samples) or self.samples < 1):
            raise UserError(f"--samples must be at least 1, got {self.samples!r}")
        if self.max_new_tokens is not None and (not _whole(self.max_new_tokens) or self.max_new_tokens < 1):
            raise UserError(f"--max-new-tokens must be at least 1, got {self.max_new_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise UserError(f"--temperature must be a finite number, 0 (greedy) or more, got {self.temperature}")
        if not isinstance(self.top_p, (int, float)) or not math.isfinite(self.top_p) or not 0 < self.top_p <= 1:
            raise UserError(f"--top-p must be in (0, 1], got {self.top_p}")
        if not _whole(self.seed):
            raise UserError(f"--seed must be a whole number, got {self.seed!r}")


@dataclass(frozen=True)
class InferenceOptions:
    """How the model runs: loops T (None: the checkpoint's), untrained KV sharing ("first" | "last",
    Ouro only) and whether it covers the prompt, the prompt chunk C (1 = exact MELT), and sampling."""

    loops: int | None = None
    kv_sharing: str | None = None
    share_prompt: bool = False
    prefill_chunk: int = 1
    sampling: Sampling = field(default_factory=Sampling)

    def __post_init__(self) -> None:
        if self.loops is not None and (not _whole(self.loops) or self.loops < 1):
            raise UserError(f"--loops must be at least 1, got {self.loops!r}")
        check_kv_sharing(self.kv_sharing)
        if not _whole(self.prefill_chunk) or self.prefill_chunk < 1:
            raise UserError(f"--prefill-chunk must be at least 1, got {self.prefill_chunk!r}")
        if not isinstance(self.sampling, Sampling):
            raise TypeError(f"sampling must be a Sampling, got {type(self.sampling).__name__}")

    @classmethod
    def from_flags(cls, **flags) -> "InferenceOptions":
        """From the `melt-eval run` flags' spelling: samples, temperature, top_p, max_new_tokens and seed
        go to `sampling`, the rest are fields (a name that is neither is a TypeError)."""
        sampling = {k: flags.pop(k) for k in ("samples", "temperature", "top_p", "max_new_tokens", "seed") if k in flags}
        return cls(**flags, sampling=Sampling(**sampling))

    def for_task(self, samples: int, max_new_tokens: int) -> "InferenceOptions":
        """These options with the task's sample count and length where the run left them open."""
        s = self.sampling
        return replace(self, sampling=replace(s, samples=s.samples or samples,
                                              max_new_tokens=s.max_new_tokens or max_new_tokens))

    @property
    def sets_model_options(self) -> bool:
        """Whether any option beyond sampling is set (they apply to looped models only)."""
        return self.loops is not None or bool(self.kv_sharing) or self.share_prompt or self.prefill_chunk != 1
