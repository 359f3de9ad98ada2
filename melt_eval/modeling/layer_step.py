"""The pure parts of one (layer, loop) step, shared by the LoopLM's chunk loop, its compiled layer step and
the compiled per-token step: tensor code only (no cache), so torch.compile can take them whole.

A layer is a sandwich-norm Llama block (docs/method.md#looped-lm):

    a = input_layernorm(x);  q = RoPE(q_proj(a))
    x = x + input_layernorm_2(o_proj(Attn(q, k, v)))
    x = x + post_attention_layernorm_2(mlp(post_attention_layernorm(x)))
"""

from __future__ import annotations

import torch

from melt_eval.modeling.gates import mix

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


def attention_inputs(layer, x, h_prev, cos, sin, first_loop: bool, loop: int, need_base: bool, need_melt: bool, kv_sharing,
                     mix_weight: Tensor | None = None, last_loop: bool = False):
    """The step before attention: a_t = input_layernorm(x); q_t = RoPE(q_proj(a_t)); the base
    entries from a_t (Ouro's per-loop cache) and/or the MELT state and its entries:
    h_1 = a_1, h_t = z_t * h_{t-1} + (1 - z_t) * a_t (docs/method.md#gates).

    `mix_weight` (phase 1's alpha, `InterpolatedKV.alpha`: a float eager, a 0-dim tensor compiled, so that its ramp
    from step to step does not recompile the step): also the interpolated entries alpha * KV_MELT + (1 - alpha) *
    KV_base the chunk attends with, here so that a compiled step fuses the two lerps into its own kernels.

    Outputs nobody reads are None, since a compiled backward builds a zero gradient for each: the state h after
    the last loop (`last_loop`), and when interpolating, MELT's entries before the last loop (only the final ones
    are kept; the step's own are read through the mix). Compiled, z is returned as its chunk mean (`gate_mean`).

    The last output is x for the residual after the attention: x itself eager; compiled, a copy made in the
    norm's kernel, so that x's two gradients (through the norm here, through the residual) meet inside this
    step's compiled backward rather than in one more autograd addition per (layer, loop)."""
    a = layer.input_layernorm(x)
    h, z = None, None
    if need_melt:
        h, z = (a, None) if first_loop else layer.update_state(h_prev, a, loop, kv_sharing)
    q, entries = layer.self_attn.queries_and_keys(a, ([a] if need_base else []) + ([h] if need_melt else []), cos, sin)
    base = entries.pop(0) if need_base else None
    melt = entries.pop(0) if need_melt else None
    mixed = None if mix_weight is None else mix(base, melt, mix_weight)
    if torch.compiler.is_compiling():
        # the compiled backward copies every incoming gradient whose strides differ from its output's; the entries'
        # gradients come back in the entries' own layout (`kv_cache.entry`), dq dense in [B, c, H, hd] memory
        q = q.transpose(1, 2).contiguous().transpose(1, 2)
    if last_loop:
        h = None
    elif mix_weight is not None:
        melt = None
    # z is read for its chunk mean only: reduced inside a compiled step's kernels (eager, the caller reduces it
    # once, outside the checkpointed step, so that the recompute does not), without a gradient either way, so
    # the backward needs no zeros standing in for one
    z = gate_mean(z) if torch.compiler.is_compiling() else z.detach() if isinstance(z, Tensor) else z
    residual = x.clone() if torch.compiler.is_compiling() else x
    return q, base, melt, h, z, mixed, residual


def gate_mean(z):
    """The chunk's mean gate value, all that is read of z (training logs it per layer and loop): a 0-dim fp32
    tensor, so that z [B, c, d] is not kept until the forward ends. A mean already, a float or None passes
    through."""
    return z.detach().float().mean() if isinstance(z, Tensor) and z.dim() else z


def attention_residual_and_mlp(layer, x, heads, keep_output: bool = True, final_norm=None):
    """The step after attention: x + norm(o_proj(heads)), then the sandwich-norm MLP residual, then `final_norm`
    if given (the model's norm after a loop's last layer). Returns the new x and, with keep_output, the attention
    output o (the align loss reads it; an output nobody reads would get a zero gradient built for it in a
    compiled backward)."""
    o = layer.self_attn.output(heads)
    x = x + layer.input_layernorm_2(o)
    x = x + layer.post_attention_layernorm_2(layer.mlp(layer.post_attention_layernorm(x)))
    if final_norm is not None:
        x = final_norm(x)
    return x, o if keep_output else None


class _AddGradInto(torch.autograd.Function):
    """A weight, passed through unchanged; its gradient is added into `grad` in place and not handed back to
    autograd. In a compiled backward the addition fuses into the kernel that casts the gradient (or into the
    matrix product, as addmm), where autograd would sum a weight's uses, one per (chunk, loop), one kernel each."""

    @staticmethod
    def forward(ctx, weight: Tensor, grad: Tensor) -> Tensor:
        ctx.grad = grad  # not saved for backward: every use adds into it, which autograd's version check would refuse
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        ctx.grad.add_(grad_output)
        return None, None


def _run_adding_grads(part, layer, stand_ins: dict[str, tuple[Tensor, Tensor]], args: tuple):
    """`part(layer, *args)` with `stand_ins[name]` = (weight, grad) for the layer's trainable weights: the layer
    computes with `weight` (the parameter, or its copy in autocast's dtype: `LoopLMModel._stand_ins`), and the
    backward adds its gradient into `grad` (the parameter's own `.grad`: `LoopLMModel.grads_in_place`) instead
    of returning it. The layer runs through its forward (`LoopLMDecoderLayer.forward(part, *args)`) and
    torch.func.functional_call."""
    weights = {name: _AddGradInto.apply(weight, grad) for name, (weight, grad) in stand_ins.items()}
    return torch.func.functional_call(layer, weights, (part, *args))


# One function each, as torch.compile keeps compiled graphs per function (a shared closure would share one cache)
def attention_inputs_adding_grads(layer, stand_ins, *args):
    return _run_adding_grads(attention_inputs, layer, stand_ins, args)


def attention_residual_and_mlp_adding_grads(layer, stand_ins, *args):
    return _run_adding_grads(attention_residual_and_mlp, layer, stand_ins, args)
