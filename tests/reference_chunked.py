"""The chunk-wise forward as it was first written: a reference for the gradient tests only.

Every (chunk, layer, loop) attends to `torch.cat([stored prefix, chunk])` under an explicit
boolean mask, and plain autograd differentiates through the copies. It is the literal
reading of docs/method.md#chunks and #interpolation; its activation memory grows
with the number of chunks, which is why the model no longer runs this way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def reference_forward(model, input_ids, attention_mask, chunk_size, alpha=1.0, first_chunk=0, exit_loops=None):
    """Per-loop logits T x [B, L, V], attention outputs [layer][loop] -> [B, L, d]. `first_chunk` > 0:
    the first that many tokens are one chunk, then chunks of chunk_size. `exit_loops` [B, L]: what a chunk
    leaves for later chunks is each token's MELT entry at its loop (docs/method.md#exit-aware-fine-tuning)."""
    inner, cfg = model.model, model.config
    T, N = cfg.total_ut_steps, cfg.num_hidden_layers
    melt = hasattr(inner.layers[0], "melt_gate")
    B, L = input_ids.shape
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    key_mask = attention_mask.bool()
    past: dict = {}
    hidden = [[] for _ in range(T)]
    attn = [[[] for _ in range(T)] for _ in range(N)]
    starts = ([0] if first_chunk else []) + list(range(min(first_chunk, L), L, chunk_size))
    for start, end in zip(starts, starts[1:] + [L]):
        c = end - start
        x = inner.embed_tokens(input_ids[:, start:end])
        cos, sin = inner.rotary_emb(position_ids[:, start:end], x.dtype)
        allowed = torch.arange(end)[None, :] <= (torch.arange(c)[:, None] + start)
        allowed = allowed[None] & key_mask[:, None, :end]
        own = torch.zeros(c, end, dtype=torch.bool)
        own[torch.arange(c), start + torch.arange(c)] = True
        mask = (allowed | own)[:, None]
        pending: dict = {}
        states = [None] * N

        def with_past(key, k, v, ran=None):
            # ran [B, 1, c, 1]: the chunk's tokens still looping; a stopped one leaves its earlier entry
            pending[key] = (k, v) if ran is None or key not in pending else (
                torch.where(ran, k, pending[key][0]), torch.where(ran, v, pending[key][1]))
            if key not in past:
                return k, v
            return torch.cat([past[key][0], k], 2), torch.cat([past[key][1], v], 2)

        for t in range(T):
            for i, layer in enumerate(inner.layers):
                a = layer.input_layernorm(x)
                q = layer.self_attn.query(a, cos, sin)
                if melt:
                    states[i] = a if t == 0 else layer.update_state(states[i], a, t + 1)[0]
                    ran = None if exit_loops is None else (exit_loops[:, start:end] > t)[:, None, :, None]
                    km, vm = with_past(("melt", i), *layer.self_attn.key_value(states[i], cos, sin), ran)
                    if alpha == 1.0:
                        k, v = km, vm
                    else:
                        kb, vb = with_past(("base", i, t), *layer.self_attn.key_value(a, cos, sin))
                        k, v = alpha * km + (1 - alpha) * kb, alpha * vm + (1 - alpha) * vb
                else:
                    k, v = with_past((i, t), *layer.self_attn.key_value(a, cos, sin))
                heads = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
                o = layer.self_attn.output(heads)
                attn[i][t].append(o)
                x = x + layer.input_layernorm_2(o)
                x = x + layer.post_attention_layernorm_2(layer.mlp(layer.post_attention_layernorm(x)))
            x = inner.norm(x)
            hidden[t].append(x)
        for key, (k, v) in pending.items():
            past[key] = (torch.cat([past[key][0], k], 2), torch.cat([past[key][1], v], 2)) if key in past else (k, v)
    logits = [model.lm_head(torch.cat(h, 1)) for h in hidden]
    return logits, [[torch.cat(o, 1) for o in per_loop] for per_loop in attn]
