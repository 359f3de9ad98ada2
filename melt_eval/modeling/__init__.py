"""Model classes; importing this registers "ouro" and "melt" with transformers' Auto classes."""

from transformers import AutoConfig, AutoModelForCausalLM

from melt_eval.modeling.looplm import LoopLMConfig, LoopLMForCausalLM, LoopLMOutput
from melt_eval.modeling.melt import GATES, MeltConfig, MeltForCausalLM
from melt_eval.modeling.loading import load_model, load_tokenizer

AutoConfig.register("ouro", LoopLMConfig, exist_ok=True)
AutoConfig.register("melt", MeltConfig, exist_ok=True)
AutoModelForCausalLM.register(LoopLMConfig, LoopLMForCausalLM, exist_ok=True)
AutoModelForCausalLM.register(MeltConfig, MeltForCausalLM, exist_ok=True)

__all__ = [
    "GATES",
    "LoopLMConfig",
    "LoopLMForCausalLM",
    "LoopLMOutput",
    "MeltConfig",
    "MeltForCausalLM",
    "load_model",
    "load_tokenizer",
]
