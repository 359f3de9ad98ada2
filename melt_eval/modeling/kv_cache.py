"""Key/value storage and the attention rule of each looped variant.

A looped forward processes tokens a chunk at a time (MELT.md "Chunks"). For every
(layer, loop) the chunk's current keys/values are handed to a *policy*, which returns
what the chunk attends to: the stored entries of earlier tokens followed by the
chunk's own current entries. When the chunk has run all T loops, `advance(c)` makes
its entries permanent.

Two stores hold the tensors, with the same two operations:

- `ConcatStore` (training, teacher-forced forward): functional `torch.cat`, so
  autograd sees every loop's entries.
- `StaticStore` (generation): preallocated buffers. `attend` writes the current
  entries into the next free slots and returns a view up to them; a later loop
  writing the same key overwrites those slots. That *is* MELT's "the current token's
  slot is overwritten at every loop": after loop T the slot holds the final entry,
  and `advance` only moves the fill pointer.

Keys: `(layer, loop)` for a per-loop cache (Ouro: T x N entries per token), `layer`
for a shared cache (MELT: N entries per token). With a per-loop key every loop keeps
its own entries; with a shared key the last write (loop T) is what later tokens see.
"""

from __future__ import annotations

from typing import Hashable

import torch

Tensor = torch.Tensor


class ConcatStore:
    """Growing key/value lists; differentiable. Tensors are [B, kv_heads, S, head_dim]."""

    def __init__(self) -> None:
        self.past: dict[Hashable, tuple[Tensor, Tensor]] = {}
        self.pending: dict[Hashable, tuple[Tensor, Tensor]] = {}
        self.length = 0

    def attend(self, key: Hashable, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        self.pending[key] = (k, v)  # a later loop with the same key replaces this
        if key not in self.past:
            return k, v
        pk, pv = self.past[key]
        return torch.cat([pk, k], dim=2), torch.cat([pv, v], dim=2)

    def advance(self, c: int) -> None:
        for key, (k, v) in self.pending.items():
            if key in self.past:
                pk, pv = self.past[key]
                k, v = torch.cat([pk, k], dim=2), torch.cat([pv, v], dim=2)
            self.past[key] = (k, v)
        self.pending.clear()
        self.length += c

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.past.values())


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

    @classmethod
    def view_of(cls, other: "StaticStore", rows: slice, start: int) -> "StaticStore":
        """A store writing into `other`'s buffers, rows `rows`, columns from `start` on."""
        store = cls.__new__(cls)
        store.buffers = {key: (k[rows, :, start:], v[rows, :, start:]) for key, (k, v) in other.buffers.items()}
        store.capacity = other.capacity - start
        store.length = 0
        return store

    def attend(self, key: Hashable, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        end = self.length + k.shape[2]
        if end > self.capacity:
            raise RuntimeError(f"KV cache full: {end} > capacity {self.capacity}")
        kb, vb = self.buffers[key]
        kb[:, :, self.length : end] = k
        vb[:, :, self.length : end] = v
        return kb[:, :, :end], vb[:, :, :end]

    def view(self, key: Hashable) -> tuple[Tensor, Tensor]:
        kb, vb = self.buffers[key]
        return kb[:, :, : self.length], vb[:, :, : self.length]

    def copy_rows(self, src: int, dst: slice) -> None:
        for kb, vb in self.buffers.values():
            kb[dst] = kb[src]
            vb[dst] = vb[src]

    def advance(self, c: int) -> None:
        self.length += c

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.buffers.values())


# --- policies: which entries a chunk attends to at (layer, loop) -------------------------------


class PerLoopKV:
    """Ouro: at loop t a token attends to the loop-t entries of all tokens."""

    needs_base, needs_melt = True, False

    def __init__(self, store) -> None:
        self.store = store

    @property
    def past_length(self) -> int:
        return self.store.length

    def kv(self, layer, loop, base, melt):
        return self.store.attend((layer, loop), *base)

    def advance(self, c: int) -> None:
        self.store.advance(c)


class SharedKV(PerLoopKV):
    """MELT: one entry per (layer, token); earlier tokens are seen through their final entries."""

    needs_base, needs_melt = False, True

    def kv(self, layer, loop, base, melt):
        return self.store.attend(layer, *melt)


class InterpolatedKV(PerLoopKV):
    """Phase-1 transition: KV = alpha * KV_MELT + (1 - alpha) * KV_base, for every entry.

    Both caches are kept: the base one per (layer, loop) as Ouro, the MELT one per layer.
    alpha = 0 is exactly the LoopLM, whatever the chunk size.
    """

    needs_base, needs_melt = True, True

    def __init__(self, store, alpha: float) -> None:
        super().__init__(store)
        self.alpha = alpha

    def kv(self, layer, loop, base, melt):
        kb, vb = self.store.attend(("base", layer, loop), *base)
        km, vm = self.store.attend(("melt", layer), *melt)
        a = self.alpha
        return a * km + (1 - a) * kb, a * vm + (1 - a) * vb


class PromptPerLoopThenSharedKV:
    """Untrained KV sharing "w/ prefill": the prompt keeps Ouro's per-loop cache, generated
    tokens share one entry per layer. Keys of the prompt come first, then generated tokens."""

    needs_base, needs_melt = False, True

    def __init__(self, prompt_store: StaticStore, gen_store: StaticStore) -> None:
        self.prompt_store, self.gen_store = prompt_store, gen_store

    @property
    def past_length(self) -> int:
        return self.prompt_store.length + self.gen_store.length

    def kv(self, layer, loop, base, melt):
        pk, pv = self.prompt_store.view((layer, loop))
        gk, gv = self.gen_store.attend(layer, *melt)
        return torch.cat([pk, gk], dim=2), torch.cat([pv, gv], dim=2)

    def advance(self, c: int) -> None:
        self.gen_store.advance(c)
