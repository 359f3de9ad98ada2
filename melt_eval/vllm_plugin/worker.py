"""Worker extension (vLLM `worker_extension_cls`): lets the harness read the allocated KV cache.

Called by name through `LLM.collective_rpc("melt_eval_kv_report")`, so it works whether the
engine runs in the harness's process or in vLLM's worker processes (no pickled callables).
"""

from __future__ import annotations


class KvCacheReport:
    def melt_eval_kv_report(self) -> dict:
        """What this worker's model runner actually allocated for the KV cache."""
        runner = self.model_runner
        config = runner.kv_cache_config
        seen, total = set(), 0
        for t in runner.kv_caches:  # one tensor per attention layer (K and V together)
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        model = runner.get_model()
        return {
            "model_class": f"{type(model).__module__}.{type(model).__qualname__}",
            "kv_bytes": total,
            "num_blocks": config.num_blocks,
            "block_size": config.kv_cache_groups[0].kv_cache_spec.block_size,
            "num_cache_layers": len(runner.kv_caches),
        }
