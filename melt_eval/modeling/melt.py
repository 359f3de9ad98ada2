"""MELT: a LoopLM whose loops share ONE key/value entry per (layer, token) (docs/method.md#shared-cache).

A token attends to the final (loop-T) entries of earlier tokens and the loop-t entries of the tokens
processed with it; the shared entry is updated at every loop by the gate rule of `gates.py`:
h_1 = a_1, h_t = z_t * h_{t-1} + (1 - z_t) * a_t, k_t = RoPE(k_proj(h_t)), v_t = v_proj(h_t).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from melt_eval.modeling.gates import GATES, LEARNED_GATES, gate_update
from melt_eval.modeling.looplm import LoopLMConfig, LoopLMDecoderLayer, LoopLMForCausalLM

Tensor = torch.Tensor

class MeltConfig(LoopLMConfig):
    model_type = "melt"

    gate: str = "elementwise"
    ema_decay: float = 0.2

    def __post_init__(self, **kwargs):
        if self.gate not in GATES:
            raise ValueError(f"unknown gate {self.gate!r}; valid gates: {', '.join(GATES)}")
        super().__post_init__(**kwargs)


class MeltGate(nn.Module):
    """The parameters of z_t (W_z, U_z, b_z for the learned gates); `gate_update` applies it."""

    def __init__(self, config: MeltConfig) -> None:
        super().__init__()
        self.kind, self.ema_decay = config.gate, config.ema_decay
        if self.kind in LEARNED_GATES:
            d = config.hidden_size
            out = d if self.kind == "elementwise" else 1
            self.a_proj = nn.Linear(d, out, bias=False)  # W_z (w_z)
            self.h_proj = nn.Linear(d, out, bias=False)  # U_z (u_z)
            self.bias = nn.Parameter(torch.zeros(out))  # b_z

    def logits(self, h_prev: Tensor, a: Tensor) -> Tensor:
        return self.a_proj(a) + self.h_proj(h_prev) + self.bias


class MeltDecoderLayer(LoopLMDecoderLayer):
    def __init__(self, config: MeltConfig) -> None:
        super().__init__(config)
        self.melt_gate = MeltGate(config)

    def update_state(self, h_prev: Tensor, a: Tensor, loop: int, kv_sharing=None) -> tuple[Tensor, Tensor | float]:
        return gate_update(self.melt_gate, h_prev, a, loop)


class MeltForCausalLM(LoopLMForCausalLM):
    config_class = MeltConfig
    layer_cls = MeltDecoderLayer
    _no_split_modules = ["MeltDecoderLayer"]

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, MeltGate) and module.kind in LEARNED_GATES:
            nn.init.normal_(module.bias, mean=0.0, std=0.02)

    def gate_parameters(self):
        """The parameters MELT adds to the LoopLM (trained with their own learning rate)."""
        return (p for n, p in self.named_parameters() if ".melt_gate." in n)

    @classmethod
    def from_looplm(
        cls, looplm: LoopLMForCausalLM, gate: str = "elementwise", seed: int = 0, ema_decay: float = 0.2
    ) -> "MeltForCausalLM":
        """Copy a LoopLM's weights and add freshly initialised gates (normal, std 0.02, seeded)."""
        cfg = looplm.config.to_dict()
        for key in ("model_type", "architectures", "transformers_version", "gate", "ema_decay"):
            cfg.pop(key, None)
        config = MeltConfig(**cfg, gate=gate, ema_decay=ema_decay)
        config.architectures = ["MeltForCausalLM"]
        param = next(looplm.parameters())
        with torch.device("meta"):
            model = cls(config)
        model = model.to_empty(device=param.device).to(param.dtype)
        missing, unexpected = model.load_state_dict(looplm.state_dict(), strict=False)
        if unexpected or any(".melt_gate." not in k for k in missing):
            raise ValueError(f"LoopLM weights do not fit MELT: missing {missing}, unexpected {unexpected}")
        model.model.rotary_emb.inv_freq.copy_(looplm.model.rotary_emb.inv_freq)
        generator = torch.Generator().manual_seed(seed)
        for p in model.gate_parameters():
            p.data.copy_(torch.randn(p.shape, generator=generator) * 0.02)
        return model.train(looplm.training)


AutoConfig.register("melt", MeltConfig, exist_ok=True)
AutoModelForCausalLM.register(MeltConfig, MeltForCausalLM, exist_ok=True)
