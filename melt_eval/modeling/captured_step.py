"""A training (layer, loop) step as two whole compiled graphs: its forward, and its recompute with its backward.

`compile_layer_step` compiles the parts before and after the attention and leaves the attention to eager code,
because the training store addresses a chunk's prefix by Python ints (`kv_cache.TrainingKVBuffer`). Here the step
takes its key's store buffer whole, all S columns (the padded length, a dynamic size of the graphs), and the
chunk's start as a device-side 0-dim tensor, so the whole step, attention included, is one function of tensors
(docs/method.md#chunks):

    keys  = prefix with the chunk's own entry written at columns [start, start + c)
    heads = softmax(q k^T / sqrt(hd) + M) v,  M[i, j] = 0 where j <= start + i, -inf elsewhere

Column j <= start + i is an earlier token's final entry or, within the chunk, the entry of a token at or before
i: the bottom-right causal rule of `kv_cache.chunk_attention`, over S keys instead of start + c. No shape
depends on the chunk's index, so each graph compiles once (`fullgraph=True`) and replays at every chunk; on CUDA
they can be replayed as CUDA graphs (`LoopLMModel.compile_captured_step(cuda_graphs=True)`).

The forward keeps only the step's inputs x and h_{t-1} (the step is its own activation checkpoint). The backward
runs the step again under `torch.func.vjp` inside one compiled graph, adds the weights' gradients into their
`.grad` and the prefix's into the store's fp32 gradient buffer in place, and returns the gradients of x and
h_{t-1}. The columns past start + c hold zeros or later chunks' entries: masked, their probabilities are 0, so
they add nothing to the output nor to the prefix's gradient, and the chunk's own columns take no prefix gradient
(the entry written over them does).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from melt_eval.modeling.kv_cache import InterpolatedKV, PerLoopKV, SharedKV, TrainingKVBuffer, _autocast_state
from melt_eval.modeling.layer_step import attention_inputs, attention_residual_and_mlp, compute_dtype

Tensor = torch.Tensor


@dataclass(frozen=True)
class StepKind:
    """What a (layer, loop) step computes besides its tensors; each kind is its own compiled graph."""

    first_loop: bool
    loop: int  # 1-based
    last_loop: bool
    need_base: bool
    need_melt: bool
    kv_sharing: str | None
    attend_with: str  # "base" (Ouro's per-loop cache), "melt" (MELT's shared one) or "mixed" (phase 1)
    keep_o: bool
    final_norm: bool  # the loop's last layer applies the model's norm
    autocast: tuple  # (device type, enabled, dtype) of the forward: the backward's recompute runs under it


def attend_over_capacity(q: Tensor, kv: Tensor, prefix: Tensor, start: Tensor) -> Tensor:
    """The chunk's heads [B, H, c, hd]: q [B, H, c, hd] over the S columns of `prefix` [2, B, KVH, S, hd] with
    the chunk's entry kv [2, B, KVH, c, hd] written at columns [start, start + c) (out of place: the store's
    buffer is only read, and the write is differentiable in both)."""
    c, S = q.shape[2], prefix.shape[3]
    columns = start + torch.arange(c, device=q.device)  # [c]
    k, v = prefix.index_copy(3, columns, kv.to(prefix.dtype))
    allowed = torch.arange(S, device=q.device) <= columns[:, None]  # [c, S]
    mask = torch.zeros((), dtype=q.dtype, device=q.device).masked_fill(~allowed, float("-inf"))
    return F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask,
                                          enable_gqa=q.shape[1] != k.shape[1])


def step(layer, norm, weights: dict, norm_weight, x, h_prev, cos, sin, prefix, start, mix_weight, kind: StepKind):
    """The (layer, loop) step, a pure function of its tensors: (x, h_t, o, z, base, melt) as `LoopLMModel._layer_step`
    returns them (None where the kind has no such output). `weights` replace the layer's trainable parameters and
    `norm_weight` the final norm's (torch.func.functional_call), so that vjp can differentiate them."""

    def body(lay, x, h_prev):
        q, base, melt, h, z, mixed, residual = attention_inputs(
            lay, x, h_prev, cos, sin, kind.first_loop, kind.loop, kind.need_base, kind.need_melt, kind.kv_sharing,
            mix_weight, kind.last_loop)
        kv = {"base": base, "melt": melt, "mixed": mixed}[kind.attend_with]
        heads = attend_over_capacity(q, kv, prefix, start)
        x, o = attention_residual_and_mlp(lay, residual, heads, kind.keep_o)
        return x, h, o, z, base, melt

    x, h, o, z, base, melt = torch.func.functional_call(layer, weights, (body, x, h_prev))
    if kind.final_norm:
        x = torch.func.functional_call(norm, {} if norm_weight is None else {"weight": norm_weight}, (x,))
    return x, h, o, z, base, melt


def step_forward(layer, norm, weights, norm_weight, x, h_prev, cos, sin, prefix, start, mix_weight, kind):
    with torch.no_grad():
        return step(layer, norm, weights, norm_weight, x, h_prev, cos, sin, prefix, start, mix_weight, kind)


def step_backward(layer, norm, weights, grads, norm_weight, norm_grad, x, h_prev, cos, sin, prefix, prefix_grad,
                  start, mix_weight, cotangents, kind):
    """The step's recompute and backward: adds d/dweights into `grads` (their .grad), d/dnorm_weight into
    `norm_grad`, d/dprefix into `prefix_grad` (the key's slice of the store's fp32 gradient buffer, which the
    commits of earlier chunks hand out); returns (dx, dh_prev). `cotangents`: the gradients of the step's differentiable outputs (x, h, o, base, melt
    where the kind has them), in that order."""
    names = list(weights)
    primals = {"weights": [weights[n] for n in names], "x": x, "prefix": prefix}
    if norm_weight is not None:
        primals["norm"] = norm_weight
    if h_prev is not None:  # None at the first loop
        primals["h_prev"] = h_prev

    def differentiable(p):
        out = step(layer, norm, dict(zip(names, p["weights"])), p.get("norm"), p["x"], p.get("h_prev"), cos, sin,
                   p["prefix"], start, mix_weight, kind)
        return tuple(t for j, t in enumerate(out) if j != 3 and t is not None)  # all but z

    device_type, enabled, dtype = kind.autocast
    # the recompute under the forward's autocast; the backward outside it, as autograd runs a backward
    with torch.autocast(device_type, enabled=enabled, dtype=dtype) if dtype is not None else contextlib.nullcontext():
        _, vjp_fn = torch.func.vjp(differentiable, primals)
    (d,) = vjp_fn(tuple(cotangents))
    for grad, dw in zip(grads, d["weights"]):
        grad.add_(dw)
    if norm_grad is not None:
        norm_grad.add_(d["norm"])
    prefix_grad.add_(d["prefix"])
    return d["x"], d.get("h_prev")


class CapturedLayerStep(torch.autograd.Function):
    """`step` as one autograd node: x and h_{t-1} in (and the store's commit token, for the backward's order:
    `kv_cache._PrefixAttention`), the step's outputs out. Only x and h_{t-1} are saved."""

    @staticmethod
    def forward(ctx, x, h_prev, token, call: "StepCall"):
        ctx.call = call
        ctx.save_for_backward(x, h_prev)
        out = call.forward(x, h_prev)
        z = out[3]
        if isinstance(z, Tensor):
            ctx.mark_non_differentiable(z)
        ctx.present = [t is not None for j, t in enumerate(out) if j != 3]
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dx, dh, do, dz, dbase, dmelt):
        if getattr(ctx, "backward_done", False):
            raise RuntimeError("chunk-wise training: a second backward through the same forward (a captured layer "
                               "step) is not supported; run the forward again instead of retain_graph=True")
        ctx.backward_done = True
        x, h_prev = ctx.saved_tensors
        # dense: a gradient that is a chunk's slice of a [B, L, ...] one has strides that depend on L, and the
        # backward graph is compiled for one set of strides (a copy only where B > 1)
        cotangents = [g.contiguous() for g, present in zip((dx, dh, do, dbase, dmelt), ctx.present) if present]
        dx_in, dh_prev = ctx.call.backward(x, h_prev, cotangents)
        return dx_in, dh_prev, None, None


class StepCall:
    """One (chunk, layer, loop) step's arguments, held from its forward to its backward."""

    def __init__(self, model, layer, stand_ins: dict, cos, sin, prefix, store, key, start, mix_weight, kind: StepKind):
        self.model, self.layer, self.cos, self.sin, self.prefix = model, layer, cos, sin, prefix
        self.store, self.key, self.start, self.mix_weight, self.kind = store, key, start, mix_weight, kind
        self.weights = {name: weight for name, (weight, _) in stand_ins.items()}
        self.grads = [grad for _, grad in stand_ins.values()]
        norm = model.norm.weight
        self.norm_weight, self.norm_grad = None, None
        if kind.final_norm and norm.requires_grad:
            if norm.grad is None:
                norm.grad = torch.zeros_like(norm)
            self.norm_weight, self.norm_grad = norm, norm.grad

    def _graphs(self):
        """Each step kind (loop position, final norm or not) of each chunk shape (a first prompt chunk, a ragged
        last one) is one graph of the same function: dynamo's default limit of 8 graphs per function would stop
        compiling the rest, which fullgraph makes an error. Phase 1 runs every kind twice, on the interpolated cache
        (alpha < 1) and then on the shared one (alpha = 1): 20 graphs stopped `tiny-phase1` at its step 31. Raised
        for these calls only (dynamo reads the limit when a call compiles)."""
        graphs = 2 * (4 * self.model.config.total_ut_steps + 4)
        return torch._dynamo.config.patch(recompile_limit=max(graphs, torch._dynamo.config.recompile_limit))

    def forward(self, x, h_prev):
        forward, _ = self.model.captured_step
        with self._graphs():
            return forward(self.layer, self.model.norm, self.weights, self.norm_weight, x, h_prev, self.cos, self.sin,
                           self.prefix, self.start, self.mix_weight, self.kind)

    def backward(self, x, h_prev, cotangents):
        _, backward = self.model.captured_step
        prefix_grad = self.store.grad_buffers(self.key)
        torch._dynamo.maybe_mark_dynamic(prefix_grad, 3)
        with self._graphs():
            return backward(self.layer, self.model.norm, self.weights, self.grads, self.norm_weight, self.norm_grad,
                            x, h_prev, self.cos, self.sin, self.prefix, prefix_grad,
                            self.start, self.mix_weight, cotangents, self.kind)


def applies(model, policy, mask) -> bool:
    """Whether `model`'s (layer, loop) steps run captured here: compiled so (`LoopLMModel.compile_captured_step`),
    with gradients, over a training store without padding masks (a teacher-forced forward)."""
    return (model.captured_step is not None and torch.is_grad_enabled() and mask is None
            and type(policy) in (PerLoopKV, SharedKV, InterpolatedKV) and isinstance(policy.store, TrainingKVBuffer))


def run(model, x, h_prev, cos, sin, layer, i: int, t: int, policy, start: Tensor, kv_sharing, mix_weight, keep_o: bool):
    """The (layer i, loop t) step of a chunk starting at column `start` (a device-side 0-dim tensor), captured:
    what `LoopLMModel._layer_step` returns."""
    T, N = model.config.total_ut_steps, len(model.layers)
    key, attend_with = policy.key_value(i, t, "base", "melt", "mixed")  # which entry the policy attends with
    kind = StepKind(first_loop=t == 0, loop=t + 1, last_loop=t == T - 1, need_base=policy.needs_base,
                    need_melt=policy.needs_melt, kv_sharing=kv_sharing, attend_with=attend_with, keep_o=keep_o,
                    final_norm=i == N - 1, autocast=_autocast_state(x.device.type))
    cfg = model.config
    dtype = compute_dtype(x)
    prefix = policy.store.prefix(key, N if attend_with == "melt" else N * T,
                                 (2, x.shape[0], cfg.num_key_value_heads, cfg.head_dim), x, dtype)
    torch._dynamo.maybe_mark_dynamic(prefix, 3)  # the store's length: one graph for every padded length
    call = StepCall(model, layer, model._stand_ins(layer, dtype), cos, sin, prefix, policy.store, key, start,
                    mix_weight, kind)
    return CapturedLayerStep.apply(x, h_prev, policy.store.token, call)
