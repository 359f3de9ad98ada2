"""Key/value storage and the attention rule of each cache layout (`melt_eval.cache_layout`).

A looped forward processes tokens a chunk at a time (docs/method.md#chunks). For every
(layer, loop) the chunk's current keys/values are handed to a *policy*, which picks the
store key they belong to; the store writes them into the chunk's slots (right after the
entries of earlier tokens) and attends over everything up to them. A later loop writing
the same key overwrites those slots: that *is* MELT's "the current token's slot is
overwritten at every loop". When the chunk has run all T loops, `commit` makes its
final entries permanent and moves the fill pointer.

Two stores, one rule:

- `TrainingKVBuffer` (teacher-forced forward, training): one preallocated [2, B, kv_heads, L,
  head_dim] buffer per key (keys, then values). Earlier tokens are read in place, never copied, so the
  activation memory of chunk-wise training is O(L) whatever the number of chunks. The
  autograd link from a chunk's attention back to the earlier chunks that produced its
  prefix goes through a gradient buffer (`_PrefixAttention`, `_Commit`), like
  ring-flash-attention's per-block backward: the backward of a chunk's attention adds
  the prefix's gradient into the buffer, and the backward of an earlier chunk's commit
  hands its slots' gradient to the tensors it stored. A token threaded from each commit
  into every later attention orders the backward so a commit runs after all its readers.
- `StaticStore` (generation): preallocated buffers with batch-row views, no autograd.

An entry (a chunk's keys and values for one key) is one [2, B, kv_heads, c, head_dim] tensor, k then v
(`entry`, `LoopLMAttention.queries_and_keys`): written with one copy, mixed with one lerp, and differentiated as
one tensor, so the chunked step launches one kernel where a (k, v) pair would take two. `k, v = entry` unpacks
it into views. Entries and the training store are laid out token-major in memory ([c, 2, B, kv_heads,
head_dim]): any token range of them is one dense block, so a chunk's gradient is a slice of the attention's
gradient that the step which made the entry takes without a copy, and the prefix's is added in one op.

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


def entry(k: Tensor, v: Tensor) -> Tensor:
    """k, v [B, KVH, c, hd] as one entry [2, B, KVH, c, hd], token-major in memory ([c, 2, B, KVH, hd])."""
    return torch.stack([k.permute(2, 0, 1, 3), v.permute(2, 0, 1, 3)], dim=1).permute(1, 2, 3, 0, 4)


def _token_major(shape, like: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """An uninitialised tensor of logical shape [..., 2, B, KVH, S, hd], token-major in memory ([S, ..., hd])."""
    *lead, s, hd = shape
    n = len(lead)
    return like.new_empty((s, *lead, hd), dtype=dtype or like.dtype).permute(*range(1, n + 1), 0, n + 1)


class _PrefixAttention(torch.autograd.Function):
    """A chunk's attention over the stored prefix (read in place) and its own entry kv [2, B, KVH, c, hd].

    Saves the chunk's q, kv and, where SDPA would run a flash kernel, that kernel's output and
    log-sum-exp. The backward writes kv back into the chunk's own slots unless they hold it already
    (checkpointing's recompute of the step has just written it; without checkpointing, later loops and the
    commit overwrote them; every later chunk, the only readers of these slots, has finished its backward by now),
    so the attention's keys are again the buffer's first past + c slots, read in place without
    concatenating the prefix. With the log-sum-exp saved it calls the kernel's backward, the op SDPA's own
    autograd calls, so the gradients are the same bits without running the attention again; otherwise (GQA,
    the memory-efficient or math kernels) it recomputes the attention under the forward's autocast state
    (as `torch.amp.custom_fwd`/`custom_bwd` do) and differentiates that. Either way it adds the prefix's
    gradient into the store's fp32 gradient buffer (the earlier chunks' `_Commit` backward collects it).
    """

    @staticmethod
    def forward(ctx, q, kv, token, store, key, past):
        end = past + kv.shape[3]
        kb, vb = store.write(key, kv, past)[:, :, :, :end]
        ctx.store, ctx.key, ctx.past = store, key, past
        ctx.dtypes = q.dtype, kv.dtype
        flash = _flash_inputs(q, kb, vb)
        if flash is None:
            ctx.flash = None
            ctx.save_for_backward(q, kv)
            ctx.autocast = _autocast_state(q.device.type)
            return chunk_attention(q, kb, vb)
        q_, k_all, v_all, mask = flash
        out, kept = _flash_forward(q_, k_all, v_all, mask)
        ctx.flash = [_SAVED if isinstance(t, Tensor) else t for t in kept]  # the non-tensors, in place
        ctx.save_for_backward(q_, kv, *(t for t in kept if isinstance(t, Tensor)))
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        _once(ctx, "attention over the prefix")
        store, key, past = ctx.store, ctx.key, ctx.past
        saved = ctx.saved_tensors  # once: under checkpointing each read unpacks (and a second raises)
        q, kv = saved[:2]
        end = past + kv.shape[3]
        buffer = store.buffers[key] if store.holds(key, kv, past) else store.write(key, kv.detach(), past)
        kb, vb = buffer[:, :, :, :end]
        if ctx.flash is not None:
            tensors = iter(saved[2:])
            kept = tuple(next(tensors) if t is _SAVED else t for t in ctx.flash)
            # the kernel's q dtype: autocast cast the keys so in the forward
            dq, dk, dv = _flash_backward(grad_out, q, kb.to(q.dtype), vb.to(q.dtype), kept)
        else:
            device_type, enabled, dtype = ctx.autocast
            amp = torch.autocast(device_type, enabled=enabled, dtype=dtype) if dtype is not None else contextlib.nullcontext()
            with torch.enable_grad(), amp:
                q_ = q.detach().requires_grad_()
                k_all, v_all = kb.detach().requires_grad_(), vb.detach().requires_grad_()  # views of the buffer, no copy
                out = chunk_attention(q_, k_all, v_all)
                dq, dk, dv = torch.autograd.grad(out, (q_, k_all, v_all), grad_out)
        # dk and dv as one gradient over the keys [2, B, KVH, past + c, hd], token-major like the store: its first
        # past tokens go into the prefix's gradient buffer in one op (`+=` on a slice would copy the sum onto
        # itself), the rest is the chunk's own gradient, in the layout of its entry (a compiled step that made the
        # entry copies an incoming gradient of other strides)
        dkv = entry(dk, dv)
        store.grad_buffers(key)[:, :, :, :past].add_(dkv[:, :, :, :past])
        q_dtype, kv_dtype = ctx.dtypes
        dkv = dkv[:, :, :, past:].to(kv_dtype)
        # the token needs no gradient, only its edge: the engine runs a commit's backward after every node holding
        # an edge to it has run, whether or not the edge carried a gradient
        return dq.to(q_dtype), dkv, None, None, None, None


class _Commit(torch.autograd.Function):
    """Store a chunk's final entries; in backward, return the gradient later chunks left in their slots."""

    @staticmethod
    def forward(ctx, token, store, keys, start, end, *finals):
        store.write_all(keys, finals, start)
        ctx.store, ctx.keys, ctx.start, ctx.end = store, keys, start, end
        ctx.dtype = finals[0].dtype
        return torch.zeros(())

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_token):
        _once(ctx, "commit of a chunk's entries")
        store = ctx.store
        if store.all_grads is None:  # no later chunk read the entries
            return (None,) * (5 + len(ctx.keys))
        # every key's slots in one cast (the keys share one buffer), each key's in its entry's layout. They are handed
        # out, not cleared: every reader has run, and the store lives for one forward
        grads = store.all_grads[..., ctx.start : ctx.end, :]  # [keys, 2, B, KVH, c, hd]
        n, two, b, heads, c, hd = grads.shape
        slots = grads.new_empty((n, c, two, b, heads, hd), dtype=ctx.dtype).permute(0, 2, 3, 4, 1, 5).copy_(grads)
        grads = [slots[store.index[key]] for key in ctx.keys]
        return (None, None, None, None, None, *grads)  # the token: an edge for ordering, no gradient (`_PrefixAttention`)


class _MixFinals(torch.autograd.Function):
    """A chunk's final phase-1 entries, lerp(start_j, ends[owner[j]], alpha) for every j (the N T mixes of
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
    """Per-key buffers [2, B, kv_heads, capacity, head_dim] (keys, values) for a teacher-forced pass over L tokens.

    The keys a chunk commits share one buffer [keys, 2, B, kv_heads, capacity, head_dim] (`write_all`), and so do
    their fp32 gradients: a commit writes every key's final entries in one copy, and its backward hands out
    every key's gradient in one cast, where one per key would be N T (N for a shared cache) per chunk."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.buffers: dict[Hashable, Tensor] = {}  # views of `all_buffers` for the committed keys
        self.grads: dict[Hashable, Tensor] = {}
        self.all_buffers: Tensor | None = None
        self.all_grads: Tensor | None = None
        self.index: dict[Hashable, int] = {}  # key -> its place in all_buffers
        self.length = 0
        self.token: Tensor | None = None  # output of the latest differentiable commit
        self.last_write: dict[Hashable, tuple] = {}  # key -> what was written there last (`holds`)

    def write(self, key: Hashable, kv: Tensor, start: int) -> Tensor:
        """The entry kv [2, B, KVH, c, hd] into columns [start, start + c) of the key's buffer, which it returns."""
        if key not in self.buffers:
            two, b, heads, _, hd = kv.shape
            self.buffers[key] = _token_major((two, b, heads, self.capacity, hd), kv)
        buffer = self.buffers[key]
        with torch.no_grad():
            buffer[:, :, :, start : start + kv.shape[3]] = kv
        self._record(key, kv, start)
        return buffer

    def _record(self, key: Hashable, kv: Tensor, start: int) -> None:
        """What `holds` compares. Only a backward asks, about an entry that needs a gradient; any other write just
        clears the key's record (an inference tensor has no version to read)."""
        self.last_write[key] = (start, kv.data_ptr(), kv._version, kv.shape) if kv.requires_grad else None

    def holds(self, key: Hashable, kv: Tensor, start: int) -> bool:
        """Whether the key's last write was kv itself, at `start`: its columns hold kv still. Every write goes
        through `write`, and a live kv's memory cannot have been another tensor's since kv was written, so an
        equal address, version and shape mean the same values (no reference is kept: that would hold every
        chunk's entries alive)."""
        return kv.requires_grad and self.last_write.get(key) == (start, kv.data_ptr(), kv._version, kv.shape)

    def prefix(self, key: Hashable, n_keys: int, shape: tuple, like: Tensor, dtype: torch.dtype) -> Tensor:
        """The key's buffer [2, B, KVH, capacity, hd] for a captured step (`captured_step`), which reads it whole.
        The first request allocates the shared buffer of all `n_keys` keys as zeros (a masked column must hold a
        finite value: -inf plus NaN is NaN); keys take their places in the order first asked for, the order the
        first chunk's steps, and then its commit, meet them. shape: (2, B, KVH, hd)."""
        if self.all_buffers is None:
            two, b, heads, hd = shape
            self.all_buffers = _token_major((n_keys, two, b, heads, self.capacity, hd), like, dtype).zero_()
        if key not in self.index:
            if len(self.index) == self.all_buffers.shape[0]:
                raise RuntimeError(f"a captured step asked for key {key!r} of a store holding {len(self.index)} keys")
            self.index[key] = len(self.index)
            self.buffers[key] = self.all_buffers[self.index[key]]
        return self.buffers[key]

    def write_all(self, keys: list, entries, start: int) -> None:
        """Every key's entry [2, B, KVH, c, hd] into columns [start, start + c) with one stack and one copy. The
        first call (the first chunk's commit, at start 0) allocates the keys' shared buffer."""
        if self.all_buffers is None:
            two, b, heads, _, hd = entries[0].shape
            self.all_buffers = _token_major((len(keys), two, b, heads, self.capacity, hd), entries[0])
            self.index = {key: j for j, key in enumerate(keys)}
            self.buffers.update({key: self.all_buffers[j] for key, j in self.index.items()})
        if list(self.index) != list(keys):
            raise RuntimeError(f"a commit of keys {list(keys)[:3]}... into a store holding {list(self.index)[:3]}...: "
                               "every chunk commits the same keys in the same order")
        with torch.no_grad():
            self.all_buffers[..., start : start + entries[0].shape[3], :] = torch.stack(list(entries))
        for key, kv in zip(keys, entries):
            self._record(key, kv, start)

    def grad_buffers(self, key: Hashable) -> Tensor:
        """fp32 whatever the entries' dtype: a prefix slot sums the gradients of every later chunk
        that reads it (L / C of them), which bf16's 8-bit mantissa would round at each addition."""
        if key not in self.grads:
            if key in self.index:  # every committed key's gradient at once, in the layout of their shared buffer
                if self.all_grads is None:
                    self.all_grads = torch.zeros_like(self.all_buffers, dtype=torch.float32)
                self.grads[key] = self.all_grads[self.index[key]]
            else:
                self.grads[key] = torch.zeros_like(self.buffers[key], dtype=torch.float32)
        return self.grads[key]

    def attend(self, key: Hashable, q: Tensor, kv: Tensor, past: int, token: Tensor | None,
               mask: Tensor | None = None) -> Tensor:
        """Attention output heads [B, H, c, hd] of the chunk at columns [past, past + c)."""
        end = past + kv.shape[3]
        if past == 0:  # nothing stored before: plain autograd; the chunk's commit fills the slots for later chunks
            k, v = kv  # (an unbind: its backward stacks the two gradients in one op)
            return chunk_attention(q, k, v)
        if token is None:  # no graph to link (no grad, or a prefix that needs none)
            k, v = self.write(key, kv, past)[:, :, :, :end]
            return chunk_attention(q, k, v)
        return _PrefixAttention.apply(q, kv, token, self, key, past)

    def commit(self, finals: dict[Hashable, Tensor], c: int) -> None:
        """The chunk's final entries become the prefix of later chunks."""
        start = self.length
        self.length += c
        if self.length >= self.capacity:
            return  # the last chunk: nobody reads its entries
        keys = list(finals)
        entries = [finals[key] for key in keys]
        if torch.is_grad_enabled() and any(kv.requires_grad for kv in entries):
            self.token = _Commit.apply(self.token, self, keys, start, self.length, *entries)
        else:
            self.write_all(keys, entries, start)

    @property
    def nbytes(self) -> int:
        shared = 0 if self.all_buffers is None else self.all_buffers.nbytes
        return shared + sum(buffer.nbytes for key, buffer in self.buffers.items() if key not in self.index)


class StaticStore:
    """Preallocated buffers [2, B, kv_heads, capacity, head_dim] (keys, values) per key; for generation."""

    def __init__(self, keys, batch: int, kv_heads: int, capacity: int, head_dim: int, dtype, device) -> None:
        shape = (2, batch, kv_heads, capacity, head_dim)
        self.buffers = {key: torch.zeros(shape, dtype=dtype, device=device) for key in keys}
        self.capacity = capacity
        self.length = 0
        self.token = None

    @classmethod
    def view_of(cls, other: "StaticStore", rows: slice, start: int) -> "StaticStore":
        """A store writing into `other`'s buffers, rows `rows`, columns from `start` on."""
        store = cls.__new__(cls)
        store.buffers = {key: buffer[:, rows, :, start:] for key, buffer in other.buffers.items()}
        store.capacity = other.capacity - start
        store.length = 0
        store.token = None
        return store

    def write(self, key: Hashable, kv: Tensor, start: int) -> Tensor:
        """The entry kv [2, B, KVH, c, hd] into columns [start, start + c) of the key's buffer, which it returns."""
        end = start + kv.shape[3]
        if end > self.capacity:
            raise RuntimeError(f"KV cache full: {end} > capacity {self.capacity}")
        buffer = self.buffers[key]
        buffer[:, :, :, start:end] = kv
        return buffer

    def attend(self, key: Hashable, q: Tensor, kv: Tensor, past: int | Tensor, token=None,
               mask: Tensor | None = None) -> Tensor:
        if isinstance(past, Tensor):  # one token at a device-side column [1] (`DeviceAddressedKV`)
            buffer = self.buffers[key]
            buffer.index_copy_(3, past, kv)
            k, v = buffer
            return chunk_attention(q, k, v, mask)  # the whole capacity: `mask` hides what is not a key yet
        k, v = self.write(key, kv, past)[:, :, :, : past + kv.shape[3]]
        return chunk_attention(q, k, v, mask)

    def view(self, key: Hashable) -> tuple[Tensor, Tensor]:
        k, v = self.buffers[key][:, :, :, : self.length]
        return k, v

    def copy_rows(self, src: int, dst: slice) -> None:
        for buffer in self.buffers.values():
            buffer[:, dst] = buffer[:, src, None]  # row src over rows dst, keys and values at once

    def commit(self, finals, c: int) -> None:
        self.length += c  # the slots already hold the last loop's (final) entries

    @property
    def nbytes(self) -> int:
        return sum(buffer.nbytes for buffer in self.buffers.values())


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
        return self.store.attend(key, q, kv, past, token, mask)

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
        past, c = self.store.length, melt.shape[3]
        ran = (self.exit_loops[:, past : past + c] > loop)[:, None, :, None]  # [B, 1, c, 1]: still looping at loop
        self.finals[layer] = torch.where(ran, melt, self.finals[layer])


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
        each equal to `gates.mix`'s, all N T of them in one `_foreach_lerp` (`_MixFinals`). On CUDA that is one
        multi-tensor kernel where the entries are dense, as the compiled step outputs them; the eager step's are
        views with gaps, for which torch runs one kernel per tensor."""
        keys, layers = list(self.base), list(melt_final)
        starts = [self.base[key] for key in keys]
        ends = [melt_final[layer] for layer in layers]
        owner = [layers.index(layer) for layer, _ in keys]
        if torch.is_grad_enabled() and any(t.requires_grad for t in starts + ends):
            mixed = _MixFinals.apply(self.alpha, owner, len(starts), *starts, *ends)
        else:
            mixed = torch._foreach_lerp(starts, [ends[o] for o in owner], self.alpha)
        return {("mix", *key): kv for key, kv in zip(keys, mixed)}

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
        # the last chunk's entries are read by no later token (the store's commit drops them): its N T mixes
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
        return self.store.attend(key, q, kv, past, token, mask)

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
        gk, gv = self.gen_store.write(layer, kv, self.gen_store.length)[:, :, :, : self.gen_store.length + kv.shape[3]]
        k, v = torch.cat([pk, gk], dim=2), torch.cat([pv, gv], dim=2)
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
