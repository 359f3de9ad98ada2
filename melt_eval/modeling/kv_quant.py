"""Quantized KV stores for generation: KIVI's scheme, and Ouro's cross-loop delta cache.

What is stored and its bytes are `melt_eval.cache_layout.KVQuant`'s (docs/method.md#quantized-caches):

- keys per channel: a group of G tokens shares, per channel, a scale and a minimum (keys have
  outlier channels, so a channel's range is tight across tokens: KIVI, Liu et al. 2024);
- values per token: G channels of a token share a scale and a minimum;
- codes are asymmetric min-max integers (int8: one per byte; int4: two per byte, packed along the
  head dimension), or fp8 e4m3 casts (`torch.float8_e4m3fn` storage, no scales, clamped to +-448);
- the last R committed tokens (and the group being filled) stay in the model's dtype in a window.

`QuantizedStore` speaks `StaticStore`'s language (`attend`, `commit`, `view_of`, `copy_rows`,
`length`, `nbytes`), so `kv_cache.policy_for`'s policies read it unchanged. A chunk's own entries are
never quantized before its attention: attend reads [dequantized groups, window, the chunk's k/v];
`commit` appends the chunk's final entries to the window and quantizes every group that has left it.
Group boundaries are absolute columns of the batched cache, so rows prefilled at different offsets
(right-aligned prompts) share them; padding columns hold zeros and are masked.

The cross-loop cache (FlashLoop's idea, 2026): loop 1's entries are kept in the model's dtype, loop
t > 1's as int4 KIVI codes of their difference from loop 1 (loops of a looped model write similar
keys and values, so the delta's range, and its error, is small), with the same full-precision window.

`nbytes` counts the tensors the store holds; dequantized copies made for one attention call are
transient, like the attention's own activations.
"""

from __future__ import annotations

from typing import Hashable

import torch

from melt_eval.cache_layout import KV_BITS, KV_SCALE_BYTES, CacheLayout, KVQuant
from melt_eval.modeling.kv_cache import chunk_attention

Tensor = torch.Tensor
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def scale_dtype(dtype: torch.dtype) -> torch.dtype:
    """Scales and minima are KV_SCALE_BYTES wide (cache_layout counts them so): the model's dtype if 16-bit, else
    bfloat16 (float32's range: a key's outlier channel cannot overflow it)."""
    return dtype if dtype.itemsize == KV_SCALE_BYTES else torch.bfloat16


def _pack4(codes: Tensor) -> Tensor:
    """[..., d] codes in [0, 15] -> [..., d / 2] uint8, two per byte (even channel in the low nibble)."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def _unpack4(packed: Tensor) -> Tensor:
    return torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2)


def _round(x: Tensor, dtype: torch.dtype, direction: int) -> Tensor:
    """float32 x -> the nearest `dtype` value not below it (direction 1) or not above it (-1), as float32."""
    y = x.to(dtype)
    off = y.float() < x if direction > 0 else y.float() > x
    return torch.where(off, torch.nextafter(y, torch.full_like(y, direction * float("inf"))), y).float()


def quantize(x: Tensor, dtype: str, group: int, per_channel: bool, out_dtype: torch.dtype):
    """x [B, H, n, d] -> (codes, scale, minimum): per_channel (keys) groups `group` tokens of a channel
    (n a multiple of group; scales [B, H, n / group, d]); else (values) `group` channels of a token (scales
    [B, H, n, d / group]). Scales and minima are in `out_dtype` (the store's `scale_dtype`); fp8 returns
    (codes, None, None)."""
    if dtype == "fp8":
        return x.clamp(-FP8_MAX, FP8_MAX).to(FP8), None, None
    b, h, n, d = x.shape
    xf = x.float()
    grouped = xf.view(b, h, n // group, group, d) if per_channel else xf.view(b, h, n, d // group, group)
    axis = 3 if per_channel else 4
    lo, hi = grouped.amin(axis, keepdim=True), grouped.amax(axis, keepdim=True)
    levels = 2 ** KV_BITS[dtype] - 1
    # the stored (rounded) scale and minimum are the ones quantized against, so dequantizing is exact up to
    # half a step; both rounded outwards (minimum down, scale up) so every value's code lies in [0, levels]
    lo = _round(lo, out_dtype, -1)
    scale = _round((hi - lo) / levels, out_dtype, 1)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = ((grouped - lo) / safe).round_().clamp_(0, levels).to(torch.uint8).view(b, h, n, d)
    if dtype == "int4":
        codes = _pack4(codes)
    return codes, scale.squeeze(axis).to(out_dtype), lo.squeeze(axis).to(out_dtype)


def fp8_to(codes: Tensor, out_dtype: torch.dtype, out: Tensor | None = None) -> Tensor:
    """e4m3 codes -> `out_dtype`, exactly `codes.to(out_dtype)` but through integer operations (the CPU's fp8 cast
    runs one element at a time): the byte's exponent and mantissa bits shifted into a float32's (exponent 0 is the
    float32 denormal with the same mantissa), scaled by 2^(127 - 7) to e4m3's bias. Codes are clamped to +-448,
    so no NaN is stored."""
    b = codes.view(torch.uint8).to(torch.int32)
    bits = ((b & 0x80) << 24) | ((b & 0x7F) << 20)
    if out is None:
        return (bits.view(torch.float32) * 2.0**120).to(out_dtype)
    return torch.mul(bits.view(torch.float32), 2.0**120, out=out)


def _cast_codes(codes: Tensor, dtype: str, out: Tensor) -> None:
    """Integer codes [B, H, n, d] (int4: packed [B, H, n, d / 2]) as floats into `out` [B, H, n, d]."""
    if dtype == "int4":  # low nibble -> even channel, high -> odd
        pairs = out.unflatten(-1, (-1, 2))
        torch.bitwise_and(codes, 15, out=pairs[..., 0])
        torch.bitwise_right_shift(codes, 4, out=pairs[..., 1])
    else:
        out.copy_(codes)


def dequantize(codes: Tensor, scale: Tensor | None, lo: Tensor | None, dtype: str, group: int, per_channel: bool,
               out_dtype: torch.dtype, out: Tensor | None = None, work: Tensor | None = None) -> Tensor:
    """The inverse of `quantize`: [B, H, n, d] in `out_dtype`, written into `out` ([B, H, n, d], e.g. the leading
    columns of the buffer attention reads) when given (`work`, [B, H, n, d] in `out_dtype`: room for the values'
    cast codes). Whole tensors at a time (a cast, then one fused
    multiply-add over [.., G] views): no per-group work, and no temporary for the keys."""
    b, h, n = codes.shape[:3]
    d = codes.shape[3] * (2 if dtype == "int4" else 1)
    if out is None:
        out = torch.empty(b, h, n, d, dtype=out_dtype, device=codes.device)
    if dtype == "fp8":
        return fp8_to(codes, out_dtype, out=out)
    scale, lo = scale.to(out_dtype), lo.to(out_dtype)  # [.., n / G or d / G]: 1/G of the codes, cheap to widen
    if per_channel:  # keys: [B, H, n / G, G, d], a scale per (token group, channel); in place, out = lo + out * scale
        _cast_codes(codes, dtype, out)
        grouped = out.view(b, h, n // group, group, d)
        torch.addcmul(lo[:, :, :, None], grouped, scale[:, :, :, None], out=grouped)
    else:  # values: [B, H, n, d / G, G], a scale per (token, channel group)
        x = torch.empty(b, h, n, d, dtype=out_dtype, device=codes.device) if work is None else work
        _cast_codes(codes, dtype, x)
        # the minima first, then one in-place addcmul (the same fused multiply-add as `addcmul(lo, x, scale)`):
        # with both scale and minimum broadcast along the innermost dim addcmul runs scalar code, with one it
        # stays vectorized
        grouped = out.view(b, h, n, d // group, group)
        grouped.copy_(lo[..., None].expand_as(grouped))
        grouped.addcmul_(x.view(b, h, n, d // group, group), scale[..., None])
    return out


class _Entry:
    """One store key's K and V: quantized groups plus a full-precision window, or (quant "auto") full buffers."""

    def __init__(self, quant: KVQuant, batch: int, kv_heads: int, capacity: int, head_dim: int, dtype, device):
        self.quant, self.dtype = quant, dtype
        full = (batch, kv_heads, capacity, head_dim)
        if not quant.quantized:
            self.tensors = {"k": torch.zeros(full, dtype=dtype, device=device), "v": torch.zeros(full, dtype=dtype, device=device)}
            return
        q, g = quant.quantized_tokens(capacity), quant.group
        code_dtype = FP8 if quant.dtype == "fp8" else torch.uint8
        code_dim = head_dim * KV_BITS[quant.dtype] // 8
        t = {"kc": torch.zeros(batch, kv_heads, q, code_dim, dtype=code_dtype, device=device),
             "vc": torch.zeros(batch, kv_heads, q, code_dim, dtype=code_dtype, device=device),
             "kw": torch.zeros(batch, kv_heads, quant.window_for(capacity), head_dim, dtype=dtype, device=device),
             "vw": torch.zeros(batch, kv_heads, quant.window_for(capacity), head_dim, dtype=dtype, device=device)}
        if quant.dtype != "fp8":
            sd = scale_dtype(dtype)
            for name in ("ks", "kz"):  # keys: per channel, one per group of g tokens
                t[name] = torch.zeros(batch, kv_heads, q // g, head_dim, dtype=sd, device=device)
            for name in ("vs", "vz"):  # values: per token, one per group of g channels
                t[name] = torch.zeros(batch, kv_heads, q, head_dim // g, dtype=sd, device=device)
        self.tensors = t

    def rows(self, rows: slice) -> "_Entry":
        entry = _Entry.__new__(_Entry)
        entry.quant, entry.dtype = self.quant, self.dtype
        entry.tensors = {name: t[rows] for name, t in self.tensors.items()}
        return entry

    def read(self, end: int, base: "_Entry | None") -> tuple[Tensor, Tensor]:
        """K and V of absolute columns [0, end) in the model's dtype (`base`: loop 1's entry a delta adds to)."""
        t = self.tensors
        if not self.quant.quantized:
            return t["k"][:, :, :end], t["v"][:, :, :end]
        empty = t["kw"][:, :, :0]
        return self.read_with(end, base, empty, empty)

    def read_with(self, end: int, base: "_Entry | None", k: Tensor, v: Tensor,
                  scratch: "dict[str, Tensor] | None" = None) -> tuple[Tensor, Tensor]:
        """[columns [0, end), then a chunk's own k, v [B, H, c, d]] in the model's dtype: each column written once
        into the one buffer attention reads (dequantized groups, window, chunk), no concatenation of pieces.
        `scratch` ("k", "v", "x": [B, H, >= end + c, d]) holds those buffers (the result is a view of it)."""
        t = self.tensors
        if not self.quant.quantized:  # loop 1 of the cross-loop cache
            return (torch.cat([t["k"][:, :, :end], k.to(self.dtype)], dim=2),
                    torch.cat([t["v"][:, :, :end], v.to(self.dtype)], dim=2))
        q, g, dt = self.quant.quantized_tokens(end), self.quant.group, self.quant.dtype
        b, h, _, d = t["kw"].shape
        out = []
        for name, per_channel, new in (("k", True, k), ("v", False, v)):
            if scratch is None:
                full, work = torch.empty(b, h, end + new.shape[2], d, dtype=self.dtype, device=new.device), None
            else:
                full, work = scratch[name][:, :, : end + new.shape[2]], scratch["x"][:, :, :q]
            groups = q // g if per_channel else q
            dequantize(t[name + "c"][:, :, :q], _cut(t, name + "s", groups), _cut(t, name + "z", groups), dt, g,
                       per_channel, self.dtype, out=full[:, :, :q], work=work)
            if base is not None:  # a later loop's delta: add loop 1's entries
                full[:, :, :q] += base.tensors[name][:, :, :q]
            full[:, :, q:end] = t[name + "w"][:, :, : end - q]
            full[:, :, end:] = new
            out.append(full)
        return out[0], out[1]

    def append(self, start: int, k: Tensor, v: Tensor, base: "_Entry | None") -> None:
        """Commit the entries of absolute columns [start, start + c); quantize the groups that leave the window."""
        t = self.tensors
        end = start + k.shape[2]
        if not self.quant.quantized:
            t["k"][:, :, start:end] = k
            t["v"][:, :, start:end] = v
            return
        q0, q1, g = self.quant.quantized_tokens(start), self.quant.quantized_tokens(end), self.quant.group
        kf = torch.cat([t["kw"][:, :, : start - q0], k.to(self.dtype)], dim=2)  # columns [q0, end)
        vf = torch.cat([t["vw"][:, :, : start - q0], v.to(self.dtype)], dim=2)
        if q1 > q0:
            kq, vq = kf[:, :, : q1 - q0], vf[:, :, : q1 - q0]
            if base is not None:  # the cross-loop cache stores the difference from loop 1
                bk, bv = base.tensors["k"][:, :, q0:q1], base.tensors["v"][:, :, q0:q1]
                kq, vq = kq - bk, vq - bv
            kc, ks, kz = quantize(kq, self.quant.dtype, g, True, scale_dtype(self.dtype))
            vc, vs, vz = quantize(vq, self.quant.dtype, g, False, scale_dtype(self.dtype))
            t["kc"][:, :, q0:q1], t["vc"][:, :, q0:q1] = kc, vc
            if ks is not None:
                t["ks"][:, :, q0 // g : q1 // g], t["kz"][:, :, q0 // g : q1 // g] = ks, kz
                t["vs"][:, :, q0:q1], t["vz"][:, :, q0:q1] = vs, vz
        t["kw"][:, :, : end - q1] = kf[:, :, q1 - q0 :]
        t["vw"][:, :, : end - q1] = vf[:, :, q1 - q0 :]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


def _cut(t: dict, name: str, n: int) -> Tensor | None:
    return t[name][:, :, :n] if name in t else None


class QuantizedStore:
    """`StaticStore`'s interface over quantized entries (module docstring): one `_Entry` per store key."""

    def __init__(self, layout: CacheLayout, keys, batch: int, kv_heads: int, capacity: int, head_dim: int, dtype,
                 device) -> None:
        self.layout = layout
        self.entries = {key: _Entry(layout.key_quant(key), batch, kv_heads, capacity, head_dim, dtype, device)
                        for key in keys}
        self.capacity = capacity
        self.offset = 0  # a prefill view's first column (its `length` counts from there)
        self.length = 0
        self.token = None
        self.scratch: dict[str, Tensor] = {}

    @classmethod
    def view_of(cls, other: "QuantizedStore", rows: slice, start: int) -> "QuantizedStore":
        """A store writing into `other`'s rows `rows` from column `start`; it reads its own columns only."""
        store = cls.__new__(cls)
        store.layout, store.capacity = other.layout, other.capacity
        store.entries = {key: e.rows(rows) for key, e in other.entries.items()}
        store.offset, store.length, store.token, store.scratch = start, 0, None, {}
        return store

    def _scratch(self, like: Tensor) -> dict[str, Tensor]:
        """Where one attention call's dequantized K and V are built ([B, H, capacity, d] each, and the values'
        cast codes), reused by every call: the same memory a call would allocate, and it is not cache (nbytes
        leaves it out, as it leaves out attention's activations); allocating it afresh at each call costs a
        page fault per page touched, more than the dequantization itself on a CPU."""
        if not self.scratch:
            b, h, _, d = like.shape
            self.scratch = {name: torch.empty(b, h, self.capacity, d, dtype=like.dtype, device=like.device)
                            for name in ("k", "v", "x")}
        return self.scratch

    def _base(self, key: Hashable) -> "_Entry | None":
        return self.entries[(key[0], 0)] if self.layout.cross_loop and key[1] > 0 else None

    def attend(self, key: Hashable, q: Tensor, kv: Tensor, past: int, token=None,
               mask: Tensor | None = None) -> Tensor:
        k, v = kv
        end = self.offset + past
        if end + k.shape[2] > self.capacity:
            raise RuntimeError(f"KV cache full: {end + k.shape[2]} > capacity {self.capacity}")
        entry = self.entries[key]
        scratch = self._scratch(entry.tensors["kw"]) if entry.quant.quantized else None
        keys, values = entry.read_with(end, self._base(key), k, v, scratch)
        if self.offset:  # a prefill view reads its own columns only
            keys, values = keys[:, :, self.offset :], values[:, :, self.offset :]
        return chunk_attention(q, keys, values, mask)

    def commit(self, finals, c: int) -> None:
        start = self.offset + self.length
        # loop 1's entries first: the later loops' deltas are taken against them
        for key in sorted(finals, key=lambda key: self._base(key) is not None):
            self.entries[key].append(start, *finals[key], self._base(key))
        self.length += c

    def copy_rows(self, src: int, dst: slice) -> None:
        for entry in self.entries.values():
            for t in entry.tensors.values():
                t[dst] = t[src]

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())
