"""A vLLM scheduler whose prefill chunks are exactly MELT's chunks (docs/method.md#chunks), and the
engine settings that go with it, applied by vLLM itself to every engine of a shared-KV model.

MELT's result depends on how a prompt is cut: chunk k (tokens [kC, (k+1)C)) runs all loops
attending to the final entries of earlier chunks and to its own current-loop entries.
vLLM's chunked prefill gives exactly that when every prompt is cut at multiples of C:

* `long_prefill_token_threshold = C` caps each request's prefill at C tokens per step, but
  vLLM's Scheduler skips the cap when only one request is eligible (nobody to starve).
  `ExactChunkScheduler` keeps the cap on always.
* `max_num_batched_tokens >= max_num_seqs * C` so the shared token budget never cuts a chunk short.
* Prefix caching is off (a cached prefix would skip the chunk boundaries it was built with).

`ExactChunkConfig` is registered in vLLM's per-architecture config hooks (`MODELS_CONFIG_MAP`),
so these settings hold for `vllm serve CHECKPOINT` as for the harness's in-process engine; C
comes from the config key `melt_eval_prefill_chunk` (vLLM's `--hf-overrides`), default 1.
Ouro's per-loop cache makes chunking irrelevant: it keeps vLLM's defaults.

A preempted request is recomputed from its start with the same C-sized chunks, now over its
generated tokens too; that is exact only for C = 1 (the default).
"""

from __future__ import annotations

from vllm.logger import init_logger
from vllm.model_executor.models.config import VerifyAndUpdateConfig
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from melt_eval.cache_layout import PREFILL_CHUNK_KEY, layout_of

logger = init_logger(__name__)

MAX_STEP_TOKENS = 65536  # with exact chunks, max_num_seqs * C tokens may be scheduled in one step


class ExactChunkConfig(VerifyAndUpdateConfig):
    @staticmethod
    def verify_and_update_config(vllm_config) -> None:
        model_config = vllm_config.model_config
        if not layout_of(model_config.hf_config).prefill_chunk_matters:  # Ouro's per-loop caches: any chunking
            return
        sched, cache = vllm_config.scheduler_config, vllm_config.cache_config
        chunk = int(getattr(model_config.hf_config, PREFILL_CHUNK_KEY, None) or 1)
        if chunk < 1:
            raise ValueError(f"{PREFILL_CHUNK_KEY} must be >= 1, got {chunk}")
        chunk = min(chunk, model_config.max_model_len)  # a chunk never spans more than one whole prompt
        # every running sequence must be able to take a whole chunk in one step; one step's tokens stay bounded
        sched.max_num_seqs = max(1, min(sched.max_num_seqs, MAX_STEP_TOKENS // chunk))
        sched.max_num_batched_tokens = max(sched.max_num_batched_tokens, sched.max_num_seqs * chunk)
        sched.enable_chunked_prefill = True
        sched.long_prefill_token_threshold = chunk
        cache.enable_prefix_caching = False
        if sched.scheduler_cls is None:
            sched.scheduler_cls = "melt_eval.vllm_plugin.scheduler.ExactChunkScheduler"
        elif "ExactChunkScheduler" not in str(sched.scheduler_cls):
            raise ValueError(f"MELT's chunk rule needs the melt_eval ExactChunkScheduler, not {sched.scheduler_cls}")
        logger.info("melt_eval: shared-KV model, exact prefill chunks of %d tokens, prefix caching off", chunk)


class ExactChunkScheduler(Scheduler):
    """vLLM's scheduler with the per-request prefill cap always on; the async variant when
    vLLM schedules asynchronously (decided after the config hook above, so chosen here)."""

    _scheduling = False

    def __new__(cls, *args, **kwargs):
        config = kwargs.get("vllm_config", args[0] if args else None)
        if cls is ExactChunkScheduler and getattr(getattr(config, "scheduler_config", None), "async_scheduling", False):
            cls = ExactChunkAsyncScheduler
        return super().__new__(cls)

    def schedule(self, *args, **kwargs):
        self._scheduling = True
        try:
            return super().schedule(*args, **kwargs)
        finally:
            self._scheduling = False

    def get_request_counts(self) -> tuple[int, int]:
        running, waiting = super().get_request_counts()
        # Inside schedule() the running count only decides whether the per-request prefill
        # cap applies ("more than one eligible request"); report at least two so it always does.
        return (max(running, 2), waiting) if self._scheduling else (running, waiting)


class ExactChunkAsyncScheduler(ExactChunkScheduler, AsyncScheduler):
    pass
