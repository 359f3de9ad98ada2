"""A vLLM scheduler whose prefill chunks are exactly MELT's chunks (MELT.md "Chunks").

MELT's result depends on how a prompt is cut: chunk k (tokens [kC, (k+1)C)) runs all loops
attending to the final entries of earlier chunks and to its own current-loop entries.
vLLM's chunked prefill gives exactly that when every prompt is cut at multiples of C:

* `long_prefill_token_threshold = C` caps each request's prefill at C tokens per step, but
  vLLM's Scheduler skips the cap when only one request is eligible (nobody to starve).
  `ExactChunkScheduler` keeps the cap on always.
* `max_num_batched_tokens >= max_num_seqs * C` (set by the harness) so the shared token
  budget never cuts a chunk short.
* Prefix caching is off (a cached prefix would skip the chunk boundaries it was built with).

A preempted request is recomputed from its start with the same C-sized chunks, now over its
generated tokens too; that is exact only for C = 1 (the default), which the harness notes.
"""

from __future__ import annotations

from vllm.v1.core.sched.scheduler import Scheduler


class ExactChunkScheduler(Scheduler):
    _scheduling = False

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
