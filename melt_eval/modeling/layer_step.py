"""The pure parts of one (layer, loop) step, shared by the LoopLM's chunk loop, its compiled layer step and
the compiled per-token step: tensor code only (no cache), so torch.compile can take them whole.

A layer is a sandwich-norm Llama block (docs/method.md#looped-lm):

    a = input_layernorm(x);  q = RoPE(q_proj(a))
    x = x + input_layernorm_2(o_proj(Attn(q, k, v)))
    x = x + post_attention_layernorm_2(mlp(post_attention_layernorm(x)))
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype the projections of x produce: autocast's where it is on, else x's own.

    Under autocast the embedding output stays fp32 while q/k/v come out bf16; cos/sin must take
    the projections' dtype, or RoPE promotes q and k back to fp32 and they no longer match v
    (SDPA's lower-right causal path checks that before autocast could cast them)."""
    device_type = x.device.type
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return x.dtype


def attention_inputs(layer, x, h_prev, cos, sin, first_loop: bool, loop: int, need_base: bool, need_melt: bool, kv_sharing):
    """The step before attention: a_t = input_layernorm(x); q_t = RoPE(q_proj(a_t)); the base
    entries from a_t (Ouro's per-loop cache) and/or the MELT state and its entries:
    h_1 = a_1, h_t = z_t * h_{t-1} + (1 - z_t) * a_t (docs/method.md#gates)."""
    a = layer.input_layernorm(x)
    h, z = None, None
    if need_melt:
        h, z = (a, None) if first_loop else layer.update_state(h_prev, a, loop, kv_sharing)
    q, entries = layer.self_attn.queries_and_keys(a, ([a] if need_base else []) + ([h] if need_melt else []), cos, sin)
    base = entries.pop(0) if need_base else None
    melt = entries.pop(0) if need_melt else None
    return q, base, melt, h, z


def attention_residual_and_mlp(layer, x, heads):
    """The step after attention: x + norm(o_proj(heads)), then the sandwich-norm MLP residual."""
    o = layer.self_attn.output(heads)
    x = x + layer.input_layernorm_2(o)
    x = x + layer.post_attention_layernorm_2(layer.mlp(layer.post_attention_layernorm(x)))
    return x, o
