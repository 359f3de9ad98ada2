"""Key/value storage and the attention rule of each cache layout (`melt_eval.cache_layout`).

A looped forward processes tokens a chunk at a time (docs/method.md#chunks). For every
(layer, loop) the chunk's current keys/values are handed to a *policy*, which picks the
store key they belong to; the store writes them into the chunk's slots (right after the
entries of earlier tokens) and attends over everything up to them. A later loop writing
the same key overwrites those slots: that *is* MELT's "the current token's slot is
overwritten at every loop". When the chunk has run all T loops, `commit` makes its
final entries permanent and moves the fill pointer.

Two stores, one rule:

- `TrainingKVBuffer` (teacher-forced forward, training): one preallocated [B, kv_heads, L,
  head_dim] buffer per key. Earlier tokens are read in place, never copied, so the
  activation memory of chunk-wise training is O(L) whatever the number of chunks. The
  autograd link from a chunk's attention back to the earlier chunks that produced its
  prefix goes through a gradient buffer (`_PrefixAttention`, `_Commit`), like
  ring-flash-attention's per-block backward: the backward of a chunk's attention adds
  the prefix's gradient into the buffer, and the backward of an earlier chunk's commit
  hands its slots' gradient to the tensors it stored. A token threaded from each commit
  into every later attention orders the backward so a commit runs after all its readers.
- `StaticStore` (generation): preallocated buffers with batch-row views, no autograd.

Keys: `(layer, loop)` for a per-loop cache (Ouro: T x N entries per token), `layer` for a
shared cache (MELT: N entries per token), `("mix", layer, loop)` for phase 1's
interpolated cache (alpha < 1).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Hashable

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.nn.attention import SDPBackend
from torch.nn.attention.bias import causal_lower_right

Tensor = torch.Tensor


def chunk_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None) -> Tensor:
    """Attention of a chunk's c queries [B, H, c, hd] over S = past + c keys [B, KVH, S, hd].

    Without an explicit mask this is the bottom-right-aligned causal rule (the chunk sees all
    earlier tokens and itself causally): `is_causal` when there is no past, and
    `causal_lower_right` otherwise, which CUDA's flash/efficient kernels run without a mask
    tensor. `mask` [B|1, 1, c, S] is for generation over padded rows only.
    """
    c, s = q.shape[2], k.shape[2]
    gqa = q.shape[1] != k.shape[1]
    if mask is not None or c == 1:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    if c == s:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    if q.device.type == "cpu":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=lower_right_mask(c, s, q.dtype, q.device, torch.is_inference_mode_enabled()),
                                              enable_gqa=gqa)
    if gqa:  # the lower-right kernels take equal head counts
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(c, s))


@functools.lru_cache(maxsize=2)
def lower_right_mask(c: int, s: int, dtype: torch.dtype, device: torch.device, inference_mode: bool = False) -> Tensor:
    """The additive bottom-right causal mask [c, s] (0 where query i may see key j <= s - c + i, -inf elsewhere).

    For the CPU only: its SDPA materialises `causal_lower_right`'s mask at every call (five ops at every
    (layer, loop), forward, recompute and backward), while CUDA's kernels take the bias without a mask. Every
    (layer, loop) of a chunk, and its backward, attend at the same (c, s), so the mask is built once per chunk;
    two entries cover a chunk's forward next to the backward of another. Read-only: SDPA never writes it. Keyed
    on inference mode too: a mask made under `torch.inference_mode` cannot be saved for a later backward."""
    allowed = torch.ones(c, s, dtype=torch.bool, device=device).tril(s - c)
    return torch.zeros(c, s, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))


def _autocast_state(device_type: str) -> tuple[str, bool, torch.dtype | None]:
    if not torch.amp.is_autocast_available(device_type):  # the meta device (memory projections)
        return device_type, False, None
    return device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)


def _once(ctx, what: str) -> None:
    """Refuse a second backward through the same forward (`retain_graph=True`).

    The store is not a function of the graph: activation checkpointing rewrites a chunk's slots
    while it recomputes, and the commits hand their gradient slots out once, so a second
    backward would read other entries and give wrong gradients without an error."""
    if getattr(ctx, "backward_done", False):
        raise RuntimeError(f"chunk-wise training: a second backward through the same forward ({what}) is not "
                           "supported; run the forward again instead of retain_graph=True")
    ctx.backward_done = True


def _autocast_cast(tensors, device_type: str):
    """What autocast does to the inputs of an op on its lower-precision list (SDPA is on it; the kernels that
    `_PrefixAttention` calls directly are not)."""
    if not torch.is_autocast_enabled(device_type):
        return tensors
    low = torch.get_autocast_dtype(device_type)
    return tuple(t.to(low) if t.is_floating_point() and t.dtype != torch.float64 else t for t in tensors)


def _flash_inputs(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor | None] | None:
    """q, k, v (and on the CPU the mask) exactly as `chunk_attention` hands them to a flash kernel for a chunk
    of c queries after a prefix, or None where it would run another kernel (GQA; dtypes or sizes flash does
    not take; backends switched off). `_PrefixAttention` calls that kernel directly to keep its log-sum-exp."""
    if q.shape[1] != k.shape[1] or q.device.type not in ("cpu", "cuda"):
        return None
    c, s = q.shape[2], k.shape[2]
    if q.device.type == "cpu":  # SDPA with the additive mask (or none at c = 1), under autocast
        q, k, v = _autocast_cast((q, k, v), "cpu")
        if not _cpu_sdpa_takes_flash(q.dtype, k.dtype, v.dtype, q.shape[-1], c > 1, torch.backends.cuda.flash_sdp_enabled()):
            return None
        return q, k, v, None if c == 1 else lower_right_mask(c, s, q.dtype, q.device, torch.is_inference_mode_enabled())
    if q.shape[-1] % 8:  # torch pads such heads for flash; not worth copying here
        return None
    if c == 1:  # plain SDPA, under autocast
        q, k, v = _autocast_cast((q, k, v), "cuda")
        return (q, k, v, None) if torch._fused_sdp_choice(q, k, v, None, 0.0, False) == int(SDPBackend.FLASH_ATTENTION) else None
    # `causal_lower_right`: its dispatch calls the flash op itself (autocast never sees it) when flash can run
    if not torch.backends.cuda.can_use_flash_attention(torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, False, False)):
        return None
    return q, k, v, None


@functools.lru_cache(maxsize=16)
def _cpu_sdpa_takes_flash(q_dtype, k_dtype, v_dtype, head_dim: int, masked: bool, flash_enabled: bool) -> bool:
    """SDPA's own kernel choice on the CPU, asked once per configuration with stand-ins of the same kind (the
    choice reads dtypes, head size, the mask's presence and the backends enabled, not values or lengths)."""
    q = torch.empty(1, 1, 2, head_dim, dtype=q_dtype)
    k, v = torch.empty(1, 1, 3, head_dim, dtype=k_dtype), torch.empty(1, 1, 3, head_dim, dtype=v_dtype)
    mask = torch.zeros(2, 3, dtype=q_dtype) if masked else None
    return torch._fused_sdp_choice(q, k, v, mask, 0.0, False) == int(SDPBackend.FLASH_ATTENTION)


def _flash_forward(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> tuple[Tensor, tuple]:
    """The flash kernel's output and what its backward needs (the op SDPA's autograd would save)."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=mask)
        return out, (out, lse, mask)
    # is_causal on this op aligns bottom-right when c < S, as `causal_lower_right` relies on
    is_causal = q.shape[2] > 1
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, is_causal, False)
    return out, (out, lse, cum_q, cum_k, max_q, max_k, is_causal, seed, offset)


def _flash_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, saved: tuple) -> tuple[Tensor, Tensor, Tensor]:
    if q.device.type == "cpu":
        out, lse, mask = saved
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse, 0.0, False, attn_mask=mask)
    out, lse, cum_q, cum_k, max_q, max_k, is_causal, seed, offset = saved
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        grad_out, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, is_causal, seed, offset)


_SAVED = object()  # marks the saved tensors' places among a flash kernel's backward arguments


class _PrefixAttention(torch.autograd.Function):
    """A chunk's attention over the stored prefix (read in place) and its own k, v.

    Saves the chunk's q, k, v and, where SDPA would run a flash kernel, that kernel's output and
    log-sum-exp. The backward writes k, v back into the chunk's own slots (later loops and the commit
    overwrote them; every later chunk, the only readers of these slots, has finished its backward by now),
    so the attention's keys are again the buffer's first past + c slots, read in place without
    concatenating the prefix. With the log-sum-exp saved it calls the kernel's backward, the op SDPA's own
    autograd calls, so the gradients are the same bits without running the attention again; otherwise (GQA,
    the memory-efficient or math kernels) it recomputes the attention under the forward's autocast state
    (as `torch.amp.custom_fwd`/`custom_bwd` do) and differentiates that. Either way it adds the prefix's
    gradient into the store's fp32 gradient buffer (the earlier chunks' `_Commit` backward collects it).
    """

    @staticmethod
    def forward(ctx, q, k, v, token, store, key, past):
        kb, vb = store.write(key, k, v, past)
        end = past + k.shape[2]
        ctx.store, ctx.key, ctx.past = store, key, past
        ctx.dtypes = q.dtype, k.dtype, v.dtype
        flash = _flash_inputs(q, kb[:, :, :end], vb[:, :, :end])
        if flash is None:
            ctx.flash = None
            ctx.save_for_backward(q, k, v)
            ctx.autocast = _autocast_state(q.device.type)
            return chunk_attention(q, kb[:, :, :end], vb[:, :, :end])
        q_, k_all, v_all, mask = flash
        out, kept = _flash_forward(q_, k_all, v_all, mask)
        ctx.flash = [_SAVED if isinstance(t, Tensor) else t for t in kept]  # the non-tensors, in place
        ctx.save_for_backward(q_, k, v, *(t for t in kept if isinstance(t, Tensor)))
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        _once(ctx, "attention over the prefix")
        store, key, past = ctx.store, ctx.key, ctx.past
        saved = ctx.saved_tensors  # once: under checkpointing each read unpacks (and a second raises)
        q, k, v = saved[:3]
        kb, vb = store.write(key, k.detach(), v.detach(), past)
        end = past + k.shape[2]
        if ctx.flash is not None:
            tensors = iter(saved[3:])
            kept = tuple(next(tensors) if t is _SAVED else t for t in ctx.flash)
            # the kernel's q dtype: autocast cast the keys so in the forward
            k_all, v_all = kb[:, :, :end].to(q.dtype), vb[:, :, :end].to(q.dtype)
            dq, dk, dv = _flash_backward(grad_out, q, k_all, v_all, kept)
        else:
            device_type, enabled, dtype = ctx.autocast
            amp = torch.autocast(device_type, enabled=enabled, dtype=dtype) if dtype is not None else contextlib.nullcontext()
            with torch.enable_grad(), amp:
                q_ = q.detach().requires_grad_()
                k_all = kb[:, :, :end].detach().requires_grad_()  # views of the buffer, no copy
                v_all = vb[:, :, :end].detach().requires_grad_()
                out = chunk_attention(q_, k_all, v_all)
                dq, dk, dv = torch.autograd.grad(out, (q_, k_all, v_all), grad_out)
        gk, gv = store.grad_buffers(key)
        gk[:, :, :past].add_(dk[:, :, :past])  # (`+=` on a slice would copy the sum onto itself)
        gv[:, :, :past].add_(dv[:, :, :past])
        # the token needs no gradient, only its edge: the engine runs a commit's backward after every node holding
        # an edge to it has run, whether or not the edge carried a gradient
        q_dtype, k_dtype, v_dtype = ctx.dtypes
        return dq.to(q_dtype), dk[:, :, past:].to(k_dtype), dv[:, :, past:].to(v_dtype), None, None, None, None


class _Commit(torch.autograd.Function):
    """Store a chunk's final entries; in backward, return the gradient later chunks left in their slots."""

    @staticmethod
    def forward(ctx, token, store, keys, start, end, *finals):
        for i, key in enumerate(keys):
            store.write(key, finals[2 * i], finals[2 * i + 1], start)
        ctx.store, ctx.keys, ctx.start, ctx.end = store, keys, start, end
        ctx.dtypes = [t.dtype for t in finals]
        return torch.zeros(())

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_token):
        _once(ctx, "commit of a chunk's entries")
        store, start, end = ctx.store, ctx.start, ctx.end
        grads = []
        for i, key in enumerate(ctx.keys):
            if key not in store.grads:  # no later chunk read this key (a single-chunk pass)
                grads += [None, None]
                continue
            # the slots are handed out, not cleared: every reader has run, and the store lives for one forward
            gk, gv = store.grads[key]
            grads += [gk[:, :, start:end].to(ctx.dtypes[2 * i]), gv[:, :, start:end].to(ctx.dtypes[2 * i + 1])]
        return (None, None, None, None, None, *grads)  # the token: an edge for ordering, no gradient (`_PrefixAttention`)


class _MixFinals(torch.autograd.Function):
    """A chunk's final phase-1 entries, lerp(start_j, ends[owner[j]], alpha) for every j (the 2 N T mixes of
    `InterpolatedKV`), forward and backward in a few multi-tensor kernels. Differentiated lerp by lerp, the
    backward would take two multiplies per mix and the T - 1 additions that sum each final MELT entry's
    gradients: several hundred kernels a chunk at the paper's depth. Here: one multiply for the starts, and for
    the ends one multiply and T - 1 multiply-adds, each over all of them at once."""

    @staticmethod
    def forward(ctx, alpha: float, owner: list[int], n_starts: int, *tensors):
        starts, ends = list(tensors[:n_starts]), tensors[n_starts:]
        ctx.alpha, ctx.owner, ctx.n_ends = alpha, owner, len(ends)
        return tuple(torch._foreach_lerp(starts, [ends[o] for o in owner], alpha))

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        alpha = ctx.alpha
        d_starts = torch._foreach_mul(list(grads), 1.0 - alpha)  # lerp's d/dstart, as autograd's formula has it
        per_end = [[] for _ in range(ctx.n_ends)]
        for grad, end in zip(grads, ctx.owner):
            per_end[end].append(grad)
        d_ends = torch._foreach_mul([g[0] for g in per_end], alpha)  # d/dend = alpha, summed over the end's mixes
        for n in range(1, len(per_end[0])):  # every end has one mix per loop
            torch._foreach_add_(d_ends, [g[n] for g in per_end], alpha=alpha)
        return (None, None, None, *d_starts, *d_ends)


class TrainingKVBuffer:
    """Per-key buffers [B, kv_heads, capacity, head_dim] for a teacher-forced pass over L tokens."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.buffers: dict[Hashable, tuple[Tensor, Tensor]] = {}
        self.grads: dict[Hashable, tuple[Tensor, Tensor]] = {}
        self.length = 0
        self.token: Tensor | None = None  # output of the latest differentiable commit

    def write(self, key: Hashable, k: Tensor, v: Tensor, start: int) -> tuple[Tensor, Tensor]:
        if key not in self.buffers:
            shape = (k.shape[0], k.shape[1], self.capacity, k.shape[3])
            self.buffers[key] = (k.new_empty(shape), v.new_empty(shape))
        kb, vb = self.buffers[key]
        with torch.no_grad():
            kb[:, :, start : start + k.shape[2]] = k
            vb[:, :, start : start + v.shape[2]] = v
        return kb, vb

    def grad_buffers(self, key: Hashable) -> tuple[Tensor, Tensor]:
        """fp32 whatever the entries' dtype: a prefix slot sums the gradients of every later chunk
        that reads it (L / C of them), which bf16's 8-bit mantissa would round at each addition."""
        if key not in self.grads:
            kb, vb = self.buffers[key]
            self.grads[key] = (torch.zeros_like(kb, dtype=torch.float32), torch.zeros_like(vb, dtype=torch.float32))
        return self.grads[key]

    def attend(self, key: Hashable, q: Tensor, k: Tensor, v: Tensor, past: int, token: Tensor | None,
               mask: Tensor | None = None) -> Tensor:
        """Attention output heads [B, H, c, hd] of the chunk at columns [past, past + c)."""
        if past == 0:  # nothing stored before: plain autograd; the slots are filled for later chunks
            if k.shape[2] < self.capacity:  # a single-chunk pass (the teacher's) has no later chunk to read them
                self.write(key, k.detach(), v.detach(), 0)
            return chunk_attention(q, k, v)
        if token is None:  # no graph to link (no grad, or a prefix that needs none)
            kb, vb = self.write(key, k, v, past)
            return chunk_attention(q, kb[:, :, : past + k.shape[2]], vb[:, :, : past + v.shape[2]])
        return _PrefixAttention.apply(q, k, v, token, self, key, past)

    def commit(self, finals: dict[Hashable, tuple[Tensor, Tensor]], c: int) -> None:
        """The chunk's final entries become the prefix of later chunks."""
        start = self.length
        self.length += c
        if self.length >= self.capacity:
            return  # the last chunk: nobody reads its entries
        keys = list(finals)
        flat = [t for key in keys for t in finals[key]]
        if torch.is_grad_enabled() and any(t.requires_grad for t in flat):
            self.token = _Commit.apply(self.token, self, keys, start, self.length, *flat)
        else:
            for key in keys:
                self.write(key, *finals[key], start)

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.buffers.values())


class StaticStore:
    """Preallocated buffers [B, kv_heads, capacity, head_dim] per key; for generation."""

    def __init__(self, keys, batch: int, kv_heads: int, capacity: int, head_dim: int, dtype, device) -> None:
        shape = (batch, kv_heads, capacity, head_dim)
        self.buffers = {
            key: (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for key in keys
        }
        self.capacity = capacity
        self.length = 0
        self.token = None

    @classmethod
    def view_of(cls, other: "StaticStore", rows: slice, start: int) -> "StaticStore":
        """A store writing into `other`'s buffers, rows `rows`, columns from `start` on."""
        store = cls.__new__(cls)
        store.buffers = {key: (k[rows, :, start:], v[rows, :, start:]) for key, (k, v) in other.buffers.items()}
        store.capacity = other.capacity - start
        store.length = 0
        store.token = None
        return store

    def write(self, key: Hashable, k: Tensor, v: Tensor, start: int) -> tuple[Tensor, Tensor]:
        end = start + k.shape[2]
        if end > self.capacity:
            raise RuntimeError(f"KV cache full: {end} > capacity {self.capacity}")
        kb, vb = self.buffers[key]
        kb[:, :, start:end] = k
        vb[:, :, start:end] = v
        return kb, vb

    def attend(self, key: Hashable, q: Tensor, k: Tensor, v: Tensor, past: int | Tensor, token=None,
               mask: Tensor | None = None) -> Tensor:
        if isinstance(past, Tensor):  # one token at a device-side column [1] (`DeviceAddressedKV`)
            kb, vb = self.buffers[key]
            kb.index_copy_(2, past, k)
            vb.index_copy_(2, past, v)
            return chunk_attention(q, kb, vb, mask)  # the whole capacity: `mask` hides what is not a key yet
        kb, vb = self.write(key, k, v, past)
        end = past + k.shape[2]
        return chunk_attention(q, kb[:, :, :end], vb[:, :, :end], mask)

    def view(self, key: Hashable) -> tuple[Tensor, Tensor]:
        kb, vb = self.buffers[key]
        return kb[:, :, : self.length], vb[:, :, : self.length]

    def copy_rows(self, src: int, dst: slice) -> None:
        for kb, vb in self.buffers.values():
            kb[dst] = kb[src]
            vb[dst] = vb[src]

    def commit(self, finals, c: int) -> None:
        self.length += c  # the slots already hold the last loop's (final) entries

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.buffers.values())


# --- policies: which entries a chunk attends to at (layer, loop) -------------------------------
#
# `key_value(layer, loop, base, melt, mixed)` gives the store key and the chunk's current entries (`mixed`: the
# interpolated entries when the step already built them, `layer_step.attention_inputs`);
# `final(layer, loop, base, melt)` records what the chunk leaves behind for later tokens.


class PerLoopKV:
    """Ouro: at loop t a token attends to the loop-t entries of all tokens."""

    needs_base, needs_melt = True, False

    def __init__(self, store) -> None:
        self.store = store
        self.finals: dict = {}

    @property
    def past_length(self) -> int:
        return self.store.length

    def key_value(self, layer, loop, base, melt, mixed=None):
        return (layer, loop), base

    def record(self, layer, loop, base, melt) -> None:
        self.finals[(layer, loop)] = base

    def attend(self, key, q, kv, past, token, mask=None) -> Tensor:
        return self.store.attend(key, q, *kv, past, token, mask)

    def advance(self, c: int) -> None:
        self.store.commit(self.finals, c)
        self.finals = {}


class SharedKV(PerLoopKV):
    """MELT: one entry per (layer, token); earlier tokens are seen through their final entries.

    `exit_loops` [B, L] (exit-aware training, docs/method.md#exit-aware-fine-tuning): the loop (1..T) at which
    each token's entry stops changing, as `--exit` leaves an exited token's entry in generation (the engine
    simply stops writing a stopped row: modeling/early_exit.py). What a chunk leaves for later chunks is then
    each token's entry at its exit loop; within its own chunk a token's slot still moves with the loops (at
    chunk 1, the rule MELT decodes with, only the token itself reads it)."""

    needs_base, needs_melt = False, True

    def __init__(self, store, exit_loops: Tensor | None = None) -> None:
        super().__init__(store)
        self.exit_loops = exit_loops

    def key_value(self, layer, loop, base, melt, mixed=None):
        return layer, melt

    def record(self, layer, loop, base, melt) -> None:
        if self.exit_loops is None or layer not in self.finals:
            self.finals[layer] = melt  # the last loop's write wins (loop 0 always writes: every exit is >= 1)
            return
        past, c = self.store.length, melt[0].shape[2]
        ran = (self.exit_loops[:, past : past + c] > loop)[:, None, :, None]  # [B, 1, c, 1]: still looping at loop
        self.finals[layer] = tuple(torch.where(ran, new, kept) for new, kept in zip(melt, self.finals[layer]))


class InterpolatedKV(PerLoopKV):
    """Phase-1 transition: KV = alpha * KV_MELT + (1 - alpha) * KV_base, for every entry.

    At loop t the chunk's own entries mix its loop-t MELT and base entries; earlier tokens
    mix their final MELT entry with their loop-t base entry, so the store keeps one mixed
    entry per (layer, loop). alpha = 0 is exactly the LoopLM, whatever the chunk size.
    """

    needs_base, needs_melt = True, True

    def __init__(self, store, alpha: float) -> None:
        super().__init__(store)
        self.alpha = alpha
        self.base: dict = {}

    def _mix_all(self, melt_final: dict) -> dict:
        """{("mix", layer, loop): the chunk's final MELT entry of the layer mixed with its loop-`loop` base entry},
        each equal to `gates.mix`'s, all 2 N T of them in one `_foreach_lerp` (`_MixFinals`). On CUDA that is one
        multi-tensor kernel where the entries are dense, as the compiled step outputs them; the eager step's are
        views with gaps, for which torch runs one kernel per tensor."""
        keys, layers = list(self.base), list(melt_final)
        starts = [e for key in keys for e in self.base[key]]
        ends = [e for layer in layers for e in melt_final[layer]]
        owner = [2 * layers.index(layer) + kv for layer, _ in keys for kv in (0, 1)]
        if torch.is_grad_enabled() and any(t.requires_grad for t in starts + ends):
            mixed = _MixFinals.apply(self.alpha, owner, len(starts), *starts, *ends)
        else:
            mixed = torch._foreach_lerp(starts, [ends[o] for o in owner], self.alpha)
        return {("mix", *key): (mixed[2 * n], mixed[2 * n + 1]) for n, key in enumerate(keys)}

    def key_value(self, layer, loop, base, melt, mixed=None):
        if mixed is None:  # the layer step mixes the chunk's entries itself (`attention_inputs`, `mix_weight`)
            raise ValueError("InterpolatedKV: the chunk's entries come mixed from the layer step")
        return ("mix", layer, loop), mixed

    def record(self, layer, loop, base, melt) -> None:
        self.base[(layer, loop)] = base
        self.finals[layer] = melt

    def advance(self, c: int) -> None:
        melt_final = self.finals
        last = self.store.length + c >= getattr(self.store, "capacity", float("inf"))
        # the last chunk's entries are read by no later token (the store's commit drops them): its 2 N T mixes
        # would be built and thrown away
        self.finals = {} if last else self._mix_all(melt_final)
        self.base = {}
        super().advance(c)


class DeviceAddressedKV:
    """A decode step's policy whose column lives on the device: one token per row, written at `column` ([1] long)
    of a `StaticStore` and attending over its whole capacity under the key mask (`LoopLMModel._mask`).

    No Python int addresses the cache, so `run_chunk` through this policy compiles once (fullgraph) and replays
    as a CUDA graph at every position (generation/decode_step.py). Per-loop (Ouro) and shared (MELT, untrained
    sharing) caches only; the caller moves the store's `length` and the column after each step."""

    def __init__(self, policy, column: Tensor) -> None:
        if type(policy) not in (PerLoopKV, SharedKV) or not isinstance(policy.store, StaticStore) or getattr(
                policy, "exit_loops", None) is not None:
            raise ValueError(f"a device-addressed decode step takes a per-loop or shared StaticStore, not {type(policy).__name__}")
        self.policy, self.store, self.column = policy, policy.store, column
        self.needs_base, self.needs_melt = policy.needs_base, policy.needs_melt

    @property
    def past_length(self) -> Tensor:
        return self.column

    def key_value(self, layer, loop, base, melt, mixed=None):
        return self.policy.key_value(layer, loop, base, melt)

    def record(self, layer, loop, base, melt) -> None:
        pass  # a static store's slot already holds the last loop's (final) entry

    def attend(self, key, q, kv, past, token, mask=None) -> Tensor:
        return self.store.attend(key, q, *kv, past, token, mask)

    def advance(self, c: int) -> None:
        pass  # outside the captured step: `DecodeStep` moves the store's length and the column


class PromptPerLoopThenSharedKV:
    """Untrained KV sharing "w/ prefill": the prompt keeps Ouro's per-loop cache, generated
    tokens share one entry per layer. Keys of the prompt come first, then generated tokens."""

    needs_base, needs_melt = False, True

    def __init__(self, prompt_store: StaticStore, gen_store: StaticStore) -> None:
        self.prompt_store, self.gen_store = prompt_store, gen_store

    @property
    def past_length(self) -> int:
        return self.prompt_store.length + self.gen_store.length

    def key_value(self, layer, loop, base, melt, mixed=None):
        return (layer, loop), melt

    def record(self, layer, loop, base, melt) -> None:
        pass

    def attend(self, key, q, kv, past, token, mask=None) -> Tensor:
        layer, loop = key
        pk, pv = self.prompt_store.view((layer, loop))
        gk, gv = self.gen_store.write(layer, *kv, self.gen_store.length)
        end = self.gen_store.length + kv[0].shape[2]
        k, v = torch.cat([pk, gk[:, :, :end]], dim=2), torch.cat([pv, gv[:, :, :end]], dim=2)
        return chunk_attention(q, k, v, mask)

    def advance(self, c: int) -> None:
        self.gen_store.length += c


def policy_for(layout, store, *, alpha: float = 1.0, generated_store: StaticStore | None = None,
               exit_loops: Tensor | None = None):
    """The one place a cache layout (`melt_eval.cache_layout.CacheLayout`) becomes an attention rule.

    alpha < 1 is phase 1's transition of a shared cache; the "w/ prefill" layout (per-loop prompt,
    shared generated tokens) prefills with Ouro's rule into `store` and decodes over both stores.
    `exit_loops` [B, L] freezes each token's shared entry at its loop (exit-aware training, `SharedKV`)."""
    if exit_loops is not None and (layout.kind != "shared" or alpha != 1.0):
        raise ValueError(f"exit_loops trains an early exit into a shared cache at alpha 1; this model's cache is "
                         f"{layout.kind} at alpha {alpha}")
    if alpha != 1.0:
        if layout.kind != "shared":
            raise ValueError(f"alpha < 1 interpolates a shared cache; this model's is {layout.kind}")
        return InterpolatedKV(store, alpha)
    if layout.kind == "shared":
        return SharedKV(store, exit_loops)
    if layout.kind == "generated_shared" and generated_store is not None:
        return PromptPerLoopThenSharedKV(store, generated_store)
    return PerLoopKV(store)
