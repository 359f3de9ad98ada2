"""`InferenceOptions`: how a model generates (loops, KV sharing, prompt chunk, sampling), checked once.

The CLI builds one (`melt-eval run` flags), `run_tasks` resolves the per-task sampling defaults
(`for_task`), and the LightEval model and the generation backends (native engine, vLLM) read it
whole. Every check of these values lives here; a wrong value is a one-line UserError naming the
flag and the values it takes. Whether `kv_sharing` fits a model's cache is for
`melt_eval.cache_layout` to say, which also owns the values it takes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from melt_eval.cache_layout import check_kv_cache_dtype, check_kv_sharing
from melt_eval.errors import UserError


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _at_least_one(value) -> bool:
    return _whole(value) and value >= 1


def _number(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


# What each sampling value must be, and how an error names it, in the order they are checked: in a run's
# spelling (its flags; `Sampling`) or in `generate()`'s (the native engine, whose callers pass the values
# one by one, as vLLM's SamplingParams; it takes no seed to check, and no value may be left to a task).
_SAMPLING_RULES = {
    "samples": _at_least_one,
    "max_new_tokens": _at_least_one,
    "temperature": lambda v: _number(v) and v >= 0,
    "top_p": lambda v: _number(v) and 0 < v <= 1,
    "seed": _whole,
}
_SAMPLING_ERRORS = {
    "flags": {
        "samples": "--samples must be at least 1, got {!r}",
        "max_new_tokens": "--max-new-tokens must be at least 1, got {!r}",
        "temperature": "--temperature must be a finite number, 0 (greedy) or more, got {}",
        "top_p": "--top-p must be in (0, 1], got {}",
        "seed": "--seed must be a whole number, got {!r}",
    },
    "arguments": {
        "max_new_tokens": "max_new_tokens must be a whole number >= 1, got {!r}",
        "samples": "the number of samples must be a whole number >= 1, got {!r}",
        "temperature": "temperature must be a finite number >= 0 (0 = greedy), got {!r}",
        "top_p": "top_p must be in (0, 1], got {!r}",
    },
}


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
        self.check(vars(self))

    @staticmethod
    def check(values: dict, *, spelling: str = "flags", error: type[Exception] = UserError) -> None:
        """The one check of sampling values: an `error` naming the first wrong one, in `spelling` ("flags":
        a run's, where samples and max_new_tokens may be None; "arguments": the native engine's)."""
        for name, message in _SAMPLING_ERRORS[spelling].items():
            value = values[name]
            if value is None and spelling == "flags" and name in ("samples", "max_new_tokens"):
                continue  # the task's own
            if not _SAMPLING_RULES[name](value):
                raise error(message.format(value))


@dataclass(frozen=True)
class InferenceOptions:
    """How the model runs: loops T (None: the checkpoint's), untrained KV sharing ("first" | "last",
    Ouro only) and whether it covers the prompt, the prompt chunk C (1 = exact MELT), and sampling."""

    loops: int | None = None
    kv_sharing: str | None = None
    share_prompt: bool = False
    prefill_chunk: int = 1
    sampling: Sampling = field(default_factory=Sampling)
    # how the cache stores its entries (melt_eval.cache_layout.KVQuant): "auto" (the model's dtype), or KIVI's
    # fp8 | int8 | int4; cross_loop_kv: Ouro's loops 2..T as int4 deltas from loop 1 (native engine only)
    kv_cache_dtype: str = "auto"
    cross_loop_kv: bool = False

    def __post_init__(self) -> None:
        if self.loops is not None and (not _whole(self.loops) or self.loops < 1):
            raise UserError(f"--loops must be at least 1, got {self.loops!r}")
        check_kv_sharing(self.kv_sharing)
        check_kv_cache_dtype(self.kv_cache_dtype)
        if not isinstance(self.cross_loop_kv, bool):
            raise UserError(f"--cross-loop-kv is a flag, got {self.cross_loop_kv!r}")
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

    def apply_loops(self, config) -> int:
        """The number of loops T a looped model runs with under these options, written into its config
        (`total_ut_steps`) and returned: `loops` where set, else the checkpoint's own. The one place --loops
        is applied: a run's config (its fingerprint, results.json's "loops", the native model) and the
        native engine's per-call T (which it restores) both come from here."""
        if self.loops is not None:
            config.total_ut_steps = self.loops
        return config.total_ut_steps

    @property
    def sets_model_options(self) -> bool:
        """Whether any option beyond sampling is set (they apply to looped models only)."""
        return (self.loops is not None or bool(self.kv_sharing) or self.share_prompt or self.prefill_chunk != 1
                or self.kv_cache_dtype != "auto" or self.cross_loop_kv)
