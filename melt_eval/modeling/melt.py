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
from melt_eval.modeling.looplm import (LoopLMConfig, LoopLMDecoderLayer, LoopLMForCausalLM, checkpoint_parts,
                                      register_checkpoint_layout)

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
            # [W_z | U_z] (w_z, u_z) as one [out, 2d] weight, W_z's columns first: a_t and h_{t-1} go through one
            # product, one weight gradient and one input gradient instead of two each (the chunked training step is
            # bound by the number of kernels it launches). Checkpoints keep a_proj and h_proj (`CHECKPOINT_LAYOUT`).
            self.ah_proj = nn.Linear(2 * d, out, bias=False)
            self.bias = nn.Parameter(torch.zeros(out))  # b_z

    def logits(self, h_prev: Tensor, a: Tensor) -> Tensor:
        """a_t W_z + h_{t-1} U_z + b_z = [a_t, h_{t-1}] [W_z | U_z]^T + b_z. The bias is added outside the product:
        under autocast the sum stays in the bias's fp32, as it was with two products."""
        return self.ah_proj(torch.cat([a, h_prev], dim=-1)) + self.bias


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
        cls, looplm: LoopLMForCausalLM, gate: str = "elementwise", seed: int = 0, ema_decay: float = 0.2,
        kv_heads: int | None = None,
    ) -> "MeltForCausalLM":
        """Copy a LoopLM's weights and add freshly initialised gates (normal, std 0.02, seeded).

        `kv_heads` K (None: the LoopLM's own) makes a grouped-query MELT: each group of consecutive key
        and value heads is mean-pooled into one (`pool_kv_heads`); the LoopLM is left unchanged."""
        cfg = looplm.config.to_dict()
        for key in ("model_type", "architectures", "transformers_version", "gate", "ema_decay"):
            cfg.pop(key, None)
        state = looplm.state_dict()
        if kv_heads is not None and kv_heads != looplm.config.num_key_value_heads:
            state = pool_kv_heads(state, looplm.config, kv_heads)
            cfg["num_key_value_heads"] = kv_heads
        config = MeltConfig(**cfg, gate=gate, ema_decay=ema_decay)
        config.architectures = ["MeltForCausalLM"]
        param = next(looplm.parameters())
        with torch.device("meta"):
            model = cls(config)
        model = model.to_empty(device=param.device).to(param.dtype)
        missing, unexpected = model.load_state_dict(state, strict=False)
        if unexpected or any(".melt_gate." not in k for k in missing):
            raise ValueError(f"LoopLM weights do not fit MELT: missing {missing}, unexpected {unexpected}")
        model.model.rotary_emb.inv_freq.copy_(looplm.model.rotary_emb.inv_freq)
        generator = torch.Generator().manual_seed(seed)
        for name, p in model.named_parameters():
            if ".melt_gate." not in name:
                continue
            # drawn per checkpoint tensor (b_z, then W_z, then U_z, as before the merge): a seed gives the same MELT
            parts, dim = checkpoint_parts(name)
            shape = list(p.shape)
            shape[dim] //= len(parts)
            p.data.copy_(torch.cat([torch.randn(shape, generator=generator) for _ in parts], dim=dim) * 0.02)
        return model.train(looplm.training)


def check_kv_heads(config, kv_heads: int) -> None:
    """Refuse a K the model's key/value heads cannot be pooled into (ValueError, one line)."""
    have = config.num_key_value_heads
    if not isinstance(kv_heads, int) or isinstance(kv_heads, bool) or kv_heads < 1 or have % kv_heads:
        divisors = [k for k in range(1, have + 1) if have % k == 0]
        raise ValueError(f"kv_heads must divide the model's {have} key/value heads ({config.num_attention_heads} "
                         f"attention heads): one of {', '.join(map(str, divisors))}; got {kv_heads!r}")


def pool_kv_heads(state: dict, config, kv_heads: int) -> dict:
    """A copy of a LoopLM state dict whose keys and values (`kv_proj`: k_proj's rows, then v_proj's) have `kv_heads`
    K heads, each the mean of a group of KVH/K consecutive original heads (Ainslie et al., 2023, GQA's conversion
    of a multi-head checkpoint).

    Consecutive, because attention gives query head j the key head j // (H/K) (`repeat_interleave`, as
    SDPA's enable_gqa and vLLM do): each new key head serves exactly the query heads its group served.
    RoPE acts on each head after the projection and is linear, so the pooled head's keys are the group's
    mean keys at every position."""
    check_kv_heads(config, kv_heads)
    have, hd = config.num_key_value_heads, config.head_dim
    out = dict(state)
    for name, w in state.items():
        if name.endswith("self_attn.kv_proj.weight"):
            d = w.shape[1]  # [2 KVH hd, d] -> [2, K, KVH/K, hd, d] -> mean over each group (in fp32 at least)
            pooled = w.to(torch.promote_types(w.dtype, torch.float32)).view(2, kv_heads, have // kv_heads, hd, d).mean(2)
            out[name] = pooled.reshape(2 * kv_heads * hd, d).to(w.dtype)
    return out


register_checkpoint_layout("melt")
AutoConfig.register("melt", MeltConfig, exist_ok=True)
AutoModelForCausalLM.register(MeltConfig, MeltForCausalLM, exist_ok=True)
