"""MELT: a LoopLM whose loops share ONE key/value entry per (layer, token) (MELT.md section 2).

Per layer, per token, loop t (a_t is the layer's attention input at loop t):

    h_1 = a_1
    h_t = z_t * h_{t-1} + (1 - z_t) * a_t              t >= 2
    k_t = RoPE(k_proj(h_t)),  v_t = v_proj(h_t),  q_t = RoPE(q_proj(a_t))

A token attends to the final (loop-T) entries of earlier tokens and the loop-t entries of
the tokens processed with it. The gate z_t selects the variant:

    elementwise  sigmoid(a_t W_z + h_{t-1} U_z + b_z), z in R^d      (MELT)
    scalar       sigmoid(a_t w_z + h_{t-1} u_z + b_z), one per token ("single-gated")
    ema          ema_decay (0.2)
    mean         (t-1)/t: h_t is the running mean of a_1..a_t
    last         0: h_t = a_t
    first        1: h_t = a_1
"""

from __future__ import annotations

import torch
from torch import nn

from melt_eval.modeling.kv_cache import InterpolatedKV, SharedKV
from melt_eval.modeling.looplm import LoopLMConfig, LoopLMDecoderLayer, LoopLMForCausalLM

Tensor = torch.Tensor

GATES = ("elementwise", "scalar", "ema", "mean", "last", "first")
LEARNED_GATES = ("elementwise", "scalar")


class MeltConfig(LoopLMConfig):
    model_type = "melt"

    gate: str = "elementwise"
    ema_decay: float = 0.2

    def __post_init__(self, **kwargs):
        if self.gate not in GATES:
            raise ValueError(f"unknown gate {self.gate!r}; valid gates: {', '.join(GATES)}")
        super().__post_init__(**kwargs)


def gate_update(gate, h_prev: Tensor, a: Tensor, loop: int) -> tuple[Tensor, Tensor | float]:
    """(h_t, z_t) with h_t = z_t * h_{t-1} + (1 - z_t) * a_t, for loop t >= 2 (the table above).

    `gate` has `.kind`, `.ema_decay` and, for the learned gates, `.logits(h_prev, a)` giving
    a_t W_z + h_{t-1} U_z + b_z: the native MeltGate and the vLLM plugin's Gate both use this one rule.
    """
    if gate.kind in LEARNED_GATES:
        z = torch.sigmoid(gate.logits(h_prev, a))
    else:
        z = {"ema": gate.ema_decay, "mean": (loop - 1) / loop, "last": 0.0, "first": 1.0}[gate.kind]
    return z * h_prev + (1 - z) * a, z


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

    def make_policy(self, store, *, alpha: float = 1.0, kv_sharing: str | None = None):
        if kv_sharing is not None:
            raise ValueError("kv_sharing applies to LoopLM (Ouro) models; MELT always shares its KV cache")
        return SharedKV(store) if alpha == 1.0 else InterpolatedKV(store, alpha)

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
