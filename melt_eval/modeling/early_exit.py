"""Early exit of generated tokens (docs/method.md#early-exit): one decode step in which each row stops
looping on its own, and the rows that stopped do no further work.

Two rules decide, after loop t < T, whether a row stops:

- ("gate", q), Ouro's: lambda_t = sigmoid(early_exit_gate(norm(h_t))); the probability of exiting at
  loop t is p_t = lambda_t * prod_{j<t} (1 - lambda_j) for t < T and the remainder at T, so the
  cumulative exit probability after loop t is CDF_t = 1 - prod_{j<=t} (1 - lambda_j). The row stops
  at the first t with CDF_t >= q (at T in any case).
- ("agree", k), training-free: the row stops once the argmax of lm_head(norm(h_t)) has been the same
  at k + 1 consecutive loops (it stayed the same for k more loops after it first appeared).

The active rows are gathered at every (layer, loop): projections, MLP and attention run over them
only, so a row that stopped after loop t costs nothing at loops t+1..T. What an exited token leaves
in the cache for later tokens:

- a shared entry per layer (MELT, Ouro's untrained sharing): its state at the exit loop (the last
  write to the slot, nothing to do);
- Ouro's per-loop cache: a copy of its exit loop's K/V in every deeper loop's cache, the "last loop"
  rule of the untrained sharing baselines, so a later token at loop t' > t reads the exited token's
  last computed entry.
"""

from __future__ import annotations

import torch

from melt_eval.modeling.kv_cache import PromptPerLoopThenSharedKV, SharedKV, chunk_attention
from melt_eval.modeling.layer_step import compute_dtype

Tensor = torch.Tensor


def _attend_rows(policy, key, rows: Tensor, q: Tensor, kv, past: int, mask: Tensor | None) -> Tensor:
    """The policy's attention for the rows `rows` only: their entries written at column `past`, the
    attention over their keys [rows, KVH, past + 1, hd] (gathered: the other rows are not read)."""
    k, v = kv
    if isinstance(policy, PromptPerLoopThenSharedKV):
        layer, loop = key
        pk, pv = policy.prompt_store.view((layer, loop))
        gk, gv = policy.gen_store.buffers[layer]
        g = policy.gen_store.length
        gk[rows, :, g : g + 1], gv[rows, :, g : g + 1] = k, v
        keys = torch.cat([pk[rows], gk[rows, :, : g + 1]], dim=2)
        values = torch.cat([pv[rows], gv[rows, :, : g + 1]], dim=2)
        return chunk_attention(q, keys, values, mask)
    kb, vb = policy.store.buffers[key]
    kb[rows, :, past : past + 1], vb[rows, :, past : past + 1] = k, v
    return chunk_attention(q, kb[rows, :, : past + 1], vb[rows, :, : past + 1], mask)


def _fill_deeper_loops(policy, rows: Tensor | slice, loop: int, loops: int, layers: int, past: int) -> None:
    """Ouro's per-loop cache: the exit loop's K/V of `rows` (indices, or a slice for the whole batch) copied
    into every deeper loop's slot."""
    if isinstance(policy, (SharedKV, PromptPerLoopThenSharedKV)):
        return  # one entry per layer: it already holds the state at the exit loop
    buffers = policy.store.buffers
    for i in range(layers):
        kb, vb = buffers[(i, loop)]
        for deeper in range(loop + 1, loops):
            dk, dv = buffers[(i, deeper)]
            dk[rows, :, past], dv[rows, :, past] = kb[rows, :, past], vb[rows, :, past]


def exit_logit(model, h: Tensor) -> Tensor:
    """Ouro's exit gate on normed loop states h [..., d] -> logits [...] (fp32): lambda_t = sigmoid(logit), the
    probability of exiting after that loop. The one owner of how lambda is computed: the engine's ("gate", q) rule,
    `early_exit_probabilities` and the exit-gate recipe's objective (training/losses.py) all call it."""
    return model.model.early_exit_gate(h).float().squeeze(-1)


class _Decider:
    """Per active row, whether it stops after a loop (the rules of the module docstring)."""

    def __init__(self, rule: tuple[str, float], rows: int, device) -> None:
        self.kind, self.value = rule
        self.survival = torch.ones(rows, device=device)  # prod_{j<=t} (1 - lambda_j)
        self.previous = torch.full((rows,), -1, dtype=torch.long, device=device)
        self.streak = torch.zeros(rows, dtype=torch.long, device=device)

    def stops(self, model, h: Tensor) -> tuple[Tensor, Tensor | None]:
        """h: [b, d] normed states of the active rows -> (stop [b] bool, their logits [b, V] if computed)."""
        if self.kind == "gate":
            lam = torch.sigmoid(exit_logit(model, h))
            self.survival = self.survival * (1 - lam)
            return 1 - self.survival >= self.value, None
        logits = model.lm_head(h).float()
        top = logits.argmax(-1)
        self.streak = torch.where(top == self.previous, self.streak + 1, torch.zeros_like(self.streak))
        self.previous = top
        return self.streak >= self.value, logits

    def keep(self, kept: Tensor) -> None:
        self.survival, self.previous, self.streak = self.survival[kept], self.previous[kept], self.streak[kept]


@torch.no_grad()
def decode_step(model, tokens: Tensor, position_ids: Tensor, policy, rule: tuple[str, float], *,
                key_mask: Tensor | None = None, kv_sharing: str | None = None) -> tuple[Tensor, Tensor]:
    """One generated token per row (tokens, position_ids: [B, 1]) through at most T loops, each row
    stopping by `rule`. Returns the logits of each row's exit loop [B, V] (fp32) and the loops each
    row ran [B] (long). The cache advances by one token, as `run_chunk` does."""
    inner = model.model
    T, N = inner.config.total_ut_steps, len(inner.layers)
    B = tokens.shape[0]
    x = inner.embed_tokens(tokens)
    cos, sin = inner.rotary_emb(position_ids, compute_dtype(x))
    past = policy.past_length
    mask = None if key_mask is None else inner._mask(1, past, key_mask, x.device, compute_dtype(x))
    rows = torch.arange(B, device=x.device)  # the active rows, as indices into the batch
    states: list[Tensor | None] = [None] * N
    logits = torch.empty(B, model.config.vocab_size, dtype=torch.float32, device=x.device)
    used = torch.full((B,), T, dtype=torch.long, device=x.device)
    decider = _Decider(rule, B, x.device)
    for t in range(T):
        everyone = rows.numel() == B  # nothing gathered while no row has stopped
        for i, layer in enumerate(inner.layers):
            q, base, melt, h, _, _, x = inner.attention_inputs(
                layer, x, states[i], cos, sin, t == 0, t + 1, policy.needs_base, policy.needs_melt, kv_sharing)
            key, kv = policy.key_value(i, t, base, melt)
            heads = (policy.attend(key, q, kv, past, None, mask) if everyone
                     else _attend_rows(policy, key, rows, q, kv, past, mask))
            x, _ = inner.attention_residual_and_mlp(layer, x, heads)
            states[i] = h
        x = inner.norm(x)
        if t == T - 1:
            logits[rows] = model.lm_head(x[:, -1]).float()
            break
        stop, loop_logits = decider.stops(model, x[:, -1])
        if not bool(stop.any()):
            continue
        done = rows[stop]
        logits[done] = loop_logits[stop] if loop_logits is not None else model.lm_head(x[stop, -1]).float()
        used[done] = t + 1
        # the whole batch stopping together (a common case for the gate rule) copies without index gathers
        everyone_stops = done.numel() == B
        _fill_deeper_loops(policy, slice(None) if everyone_stops else done, t, T, N, past)
        kept = ~stop
        rows, x, cos, sin = rows[kept], x[kept], cos[kept], sin[kept]
        states = [None if s is None else s[kept] for s in states]
        mask = None if mask is None else mask[kept]
        decider.keep(kept)
        if rows.numel() == 0:
            break
    policy.advance(1)
    return logits, used
