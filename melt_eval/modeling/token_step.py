"""Chunk-1 MELT training with one compiled function per token (recipe `compile: true` at chunk 1).

At chunk 1 (exact MELT) a training forward runs each reply token through all T loops before the next
one, and at small model sizes its time goes to dispatching T x N layer steps of small operations per
token rather than to arithmetic (docs/results/2026-11-26-benchmarks.md#one-compiled-function-per-token).
Here a token's whole chunk, every loop and layer with its attention, is one pure function,
which torch.compile turns into a few kernels, forward and backward.

The rule is the one of `kv_cache.SharedKV` (alpha = 1) and `kv_cache.InterpolatedKV` (alpha < 1):
at loop t a token attends to the earlier tokens' final MELT entries (mixed, at alpha < 1, with their
loop-t base entries) and to its own loop-t entries. The earlier tokens' entries are passed in as
[B, KVH, L, hd] tensors padded to the sequence length L (masked past the token), and the function
returns them with the token's own entries written in, so every token has the same shapes and one
compilation serves them all. They are ordinary autograd tensors, a copy per token: O(L^2) saved memory, fine for short sequences (the demo's L = 112) and not for long ones, where
the in-place store of `TrainingKVBuffer` is the path (`LoopLMForCausalLM.forward` takes this one only
when asked, at chunk 1, without activation checkpointing).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from melt_eval.modeling.kv_cache import InterpolatedKV
from melt_eval.modeling.gates import gate_update
from melt_eval.modeling.layer_step import attention_residual_and_mlp, compute_dtype, gate_mean

Tensor = torch.Tensor


def _attend(q: Tensor, prefix_k: Tensor, prefix_v: Tensor, valid: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Heads [B, H, c, hd] of c queries over the padded prefix [B, KVH, L, hd] (keys where `valid` [L])
    and the chunk's own c keys, causally."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1:  # grouped-query attention: each key head serves `rep` query heads
        prefix_k, prefix_v, k, v = (t.repeat_interleave(rep, dim=1) for t in (prefix_k, prefix_v, k, v))
    c, L = q.shape[2], prefix_k.shape[2]
    causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    scale = q.shape[-1] ** -0.5
    scores = torch.cat([(q @ prefix_k.transpose(-1, -2) * scale).masked_fill(~valid, float("-inf")),
                        (q @ k.transpose(-1, -2) * scale).masked_fill(~causal, float("-inf"))], dim=-1)
    w = torch.softmax(scores, dim=-1)  # [B, H, c, L + c]
    return w[..., :L] @ prefix_v + w[..., L:] @ v


def token_chunk(layers, norm, loops: int, x, cos, sin, prefix, valid, slot, alpha, interpolating: bool):
    """All T loops of one chunk of c tokens: one token, or the prompt (then at columns 0..c-1).

    x [B, c, d]; prefix[i][j] = (k, v) [B, KVH, L, hd]: what the earlier tokens left for layer i (j = the
    loop at alpha < 1, where they leave their final MELT entry mixed with their loop-t base entry; one
    entry at alpha = 1, their final MELT one), zeros past the columns `valid` [L] marks. `slot` [L] marks
    a one-token chunk's column; alpha is a 0-dim tensor. Shapes, not values, select the code, so one
    compilation serves every token and every step of the interpolation. Returns norm(h_T) [B, c, d];
    prefix with this chunk's entries written into its columns; and per loop and layer the normed hidden
    states, attention outputs o and the gates' chunk means, as `LoopLMModel.run_chunk` collects them.
    """
    n_layers, c, L = len(layers), x.shape[1], valid.shape[0]
    states: list[Tensor | None] = [None] * n_layers
    melt: list = [None] * n_layers
    base = [[None] * loops for _ in range(n_layers)]
    loop_hidden, attn_outputs, gates = [], [[] for _ in range(n_layers)], [[] for _ in range(n_layers)]
    for t in range(loops):
        for i, layer in enumerate(layers):
            a = layer.input_layernorm(x)
            q = layer.self_attn.query(a, cos, sin)
            # h_1 = a_1; h_t = z_t * h_{t-1} + (1 - z_t) * a_t
            h, z = (a, None) if t == 0 else gate_update(layer.melt_gate, states[i], a, t + 1)
            states[i] = h
            k, v = melt[i] = layer.self_attn.key_value(h, cos, sin)  # the last loop's are the token's final ones
            if interpolating:  # KV = alpha * KV_MELT + (1 - alpha) * KV_base
                bk, bv = base[i][t] = layer.self_attn.key_value(a, cos, sin)
                k, v = alpha * k + (1 - alpha) * bk, alpha * v + (1 - alpha) * bv
            pk, pv = prefix[i][t if interpolating else 0]
            x, o = attention_residual_and_mlp(layer, x, _attend(q, pk, pv, valid, k, v))
            attn_outputs[i].append(o)
            gates[i].append(gate_mean(z))
        x = norm(x)
        loop_hidden.append(x)

    def place(old: Tensor, new: Tensor) -> Tensor:  # new [B, KVH, c, hd] into its columns of old [B, KVH, L, hd]
        return torch.where(slot[:, None], new, old) if c == 1 else F.pad(new, (0, 0, 0, L - c))

    def left(i: int, t: int) -> tuple[Tensor, Tensor]:  # what later tokens read of this chunk
        if not interpolating:
            return melt[i]
        return tuple(alpha * m + (1 - alpha) * b for m, b in zip(melt[i], base[i][t]))

    prefix = [[tuple(place(old, new) for old, new in zip(prefix[i][j], left(i, j))) for j in range(len(prefix[i]))]
              for i in range(n_layers)]
    return x, prefix, loop_hidden, attn_outputs, gates


def applies(model, layout, chunk_size: int) -> bool:
    """The fused path serves MELT's training rules at chunk 1 when `compile_token_step` asked for it:
    a cache whose entries are all shared across loops, every token its own chunk, no checkpointing."""
    inner = model.model
    return (inner.token_step is not None and chunk_size == 1 and layout.kind == "shared"
            and not (inner.gradient_checkpointing and torch.is_grad_enabled()))


def token_steps(inner, input_ids: Tensor, position_ids: Tensor, first: int, policy):
    """(x, extra) per chunk as `LoopLMModel.run_chunk` returns them: the first `first` tokens as one chunk
    (eager: its length varies with the prompt), then one compiled call per token."""
    B, L = input_ids.shape
    x_all = inner.embed_tokens(input_ids)
    cos, sin = inner.rotary_emb(position_ids, compute_dtype(x_all))
    cfg = inner.config
    interpolating = isinstance(policy, InterpolatedKV)
    alpha = torch.tensor(policy.alpha if interpolating else 1.0, dtype=x_all.dtype, device=x_all.device)
    loops = cfg.total_ut_steps
    zeros = x_all.new_zeros(B, cfg.num_key_value_heads, L, cfg.head_dim)
    prefix = [[(zeros, zeros)] * (loops if interpolating else 1) for _ in inner.layers]
    columns = torch.arange(L, device=input_ids.device)
    first = max(1, min(first, L))
    for start, end in [(0, first)] + [(n, n + 1) for n in range(first, L)]:
        step = token_chunk if start == 0 else inner.token_step
        x, prefix, loop_hidden, attn_outputs, gates = step(
            inner.layers, inner.norm, loops, x_all[:, start:end], cos[:, :, start:end], sin[:, :, start:end],
            prefix, columns < start, columns == start, alpha, interpolating)
        yield x, {"loop_hidden": loop_hidden, "attn_outputs": attn_outputs, "gates": gates}
