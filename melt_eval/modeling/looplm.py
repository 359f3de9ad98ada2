"""Ouro LoopLM: a looped decoder that applies its N-layer stack T times (docs/method.md#looped-lm).

Loads Ouro checkpoints (config.json with model_type "ouro", Ouro's safetensors key names)
without remote code; k_proj|v_proj and gate_proj|up_proj are held as one weight each
(`CHECKPOINT_LAYOUT`), checkpoints keep them apart. Each layer is a sandwich-norm Llama block:

    a = input_layernorm(x)
    o = o_proj(Attn(RoPE(q_proj(a)), RoPE(k_proj(a)), v_proj(a)))
    x = x + input_layernorm_2(o)
    x = x + post_attention_layernorm_2(mlp(post_attention_layernorm(x)))

and after every loop `norm` is applied; its output is the next loop's input and
`lm_head(norm(h_t))` is loop t's prediction. At loop t a token attends to the loop-t
keys/values of all tokens, so the cache holds T x N entries per token.

The looped computation itself (`LoopLMModel.run_chunk`) is shared with MELT
(`melt.py`), which changes only where keys/values come from and which of them are
kept: `melt_eval.cache_layout` decides the layout, `kv_cache.policy_for` the rule that reads it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedConfig, PreTrainedModel
from transformers.conversion_mapping import register_checkpoint_conversion_mapping
from transformers.core_model_loading import Concatenate, WeightConverter
from transformers.modeling_outputs import ModelOutput

from torch.utils.checkpoint import checkpoint

from melt_eval.cache_layout import KV_SHARING, CacheLayout, layout_of  # noqa: F401 (KV_SHARING: the public name)
from melt_eval.modeling import captured_step, token_step
from melt_eval.modeling.gates import FixedGate, gate_update
from melt_eval.modeling.kv_cache import TrainingKVBuffer, entry, policy_for
from melt_eval.modeling.layer_step import (attention_inputs, attention_inputs_adding_grads, attention_residual_and_mlp,
                                           attention_residual_and_mlp_adding_grads, compute_dtype, gate_mean)

Tensor = torch.Tensor



class LoopLMConfig(PreTrainedConfig):
    model_type = "ouro"

    vocab_size: int = 49152
    hidden_size: int = 2048
    intermediate_size: int = 5632
    num_hidden_layers: int = 24
    num_attention_heads: int = 16
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 65536
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    total_ut_steps: int = 4  # T, the number of loops
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    def __post_init__(self, **kwargs):
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.rope_scaling not in (None, {}) and self.rope_scaling.get("rope_type", self.rope_scaling.get("type")) != "default":
            raise ValueError(f"rope_scaling {self.rope_scaling} is not supported (only default RoPE)")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported (Ouro uses silu)")
        super().__post_init__(**kwargs)


@dataclass
class LoopLMOutput(ModelOutput):
    loss: Tensor | None = None
    logits: Tensor | None = None  # [B, L, V], last loop
    last_hidden_state: Tensor | None = None  # [B, L, d], norm(h_T)
    loop_logits: list[Tensor] | None = None  # T x [B, L, V]
    attn_outputs: list[list[Tensor]] | None = None  # [layer][loop] -> o, [B, L, d]
    hidden_states: list[Tensor] | None = None  # T x [B, L, d], norm(h_t)
    gate_means: Tensor | None = None  # [N, T] mean z per layer and loop (MELT; loop 1 is NaN)
    loss_terms: object | None = None  # training.losses.LossTerms, when forward was given a loss_fn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        """weight * (x / sqrt(mean(x^2) + eps)): normalised in fp32 for bf16/fp32 inputs, cast back to x's dtype,
        then scaled, as Ouro does (F.rms_norm's composite computes exactly this; on CUDA, where input and weight
        share a dtype, it is one fused kernel each way)."""
        if x.dtype == self.weight.dtype:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return self.weight * F.rms_norm(x, self.weight.shape, eps=self.eps)  # e.g. a bf16 input under autocast


def rope_inv_freq(config: LoopLMConfig) -> Tensor:
    """RoPE's inverse frequencies theta^(-2i/d), i < d/2 (d = head_dim; vLLM's default get_rope uses the same)."""
    dim = config.head_dim
    return 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))


class RotaryEmbedding(nn.Module):
    """RoPE with HF Llama's rotate-half convention.

    The angles are always computed in fp32 from fp32 inverse frequencies, and only cos/sin are
    cast to the compute dtype: `inv_freq` rounded to bf16 is off by up to 4e-3 relative, which is
    more than 0.1 rad of phase at distance 10,000, so a model cast with `.to(bfloat16)` (or an
    FSDP mixed-precision policy that casts buffers) would train at positions other than the ones
    inference and vLLM (which computes its own fp32 table) use.
    """

    def __init__(self, config: LoopLMConfig) -> None:
        super().__init__()
        self.config = config
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        if self.inv_freq.dtype != torch.float32:  # `.to(dtype)` casts every floating buffer: recompute fp32
            self.inv_freq = rope_inv_freq(self.config).to(self.inv_freq.device)
        return self

    def fp32_inv_freq(self) -> Tensor:
        inv_freq = self.inv_freq
        if inv_freq.dtype != torch.float32:  # cast behind `_apply`'s back, e.g. FSDP's `buffer.data = ...`
            inv_freq = rope_inv_freq(self.config).to(inv_freq.device)
        return inv_freq

    def forward(self, position_ids: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """The tables (cos, sin) [B, 1, c, dim] of `apply_rope`, once per chunk: cos = [cos f, cos f] and
        sin = [-sin f, sin f], rotate-half's sign folded into the sin table so that applying it takes 3 kernels."""
        # elementwise fp32 ops: autocast leaves them in fp32
        freqs = position_ids[..., None].float() * self.fp32_inv_freq()  # [B, c, dim/2]
        cos, sin = freqs.cos(), freqs.sin()
        return torch.cat([cos, cos], dim=-1).to(dtype)[:, None], torch.cat([-sin, sin], dim=-1).to(dtype)[:, None]


def rotate_half(x: Tensor) -> Tensor:
    """[x1, x2] -> [-x2, x1] (HF Llama's convention), for reference: `apply_rope` takes the sign from its table."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE(x) = x * cos + rotate_half(x) * sin with the sign in the table: x * cos + [x2, x1] * [-sin, sin]
    (x [B, H, c, dim]; cos, sin from `RotaryEmbedding`): a swap of halves and two multiplies-adds."""
    swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)  # [x2, x1]
    return torch.addcmul(x * cos, swapped, sin)


class LoopLMAttention(nn.Module):
    def __init__(self, config: LoopLMConfig) -> None:
        super().__init__()
        d, hd = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, hd
        self.q_proj = nn.Linear(d, self.num_heads * hd, bias=False)
        # k_proj and v_proj read the same input (a_t, or MELT's h_t; q_proj reads a_t even where they read h_t):
        # stored as one [2 KVH hd, d] weight, k's rows first. Checkpoints keep the two tensors (`CHECKPOINT_LAYOUT`).
        self.kv_proj = nn.Linear(d, 2 * self.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.num_heads * hd, d, bias=False)

    def _heads(self, x: Tensor, n: int) -> Tensor:
        b, c, _ = x.shape
        return x.view(b, c, n, self.head_dim).transpose(1, 2)  # [B, n, c, hd]

    def query(self, a: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        return apply_rope(self._heads(self.q_proj(a), self.num_heads), cos, sin)

    def _keys_values(self, h: Tensor) -> tuple[Tensor, Tensor]:
        """k_proj(h), v_proj(h) as [B, n, KVH, hd] views of one product (h [B, n, d])."""
        b, n, _ = h.shape
        return self.kv_proj(h).view(b, n, 2, self.num_kv_heads, self.head_dim).unbind(2)

    def key_value(self, h: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        k, v = self._keys_values(h)
        return apply_rope(k.transpose(1, 2), cos, sin), v.transpose(1, 2)

    def queries_and_keys(self, a: Tensor, kv_inputs: list[Tensor], cos: Tensor, sin: Tensor):
        """`query(a)` and, for each h of `kv_inputs`, `key_value(h)` as one entry [2, B, KVH, c, hd] (k then v,
        token-major: one write, one lerp and one gradient per entry, `kv_cache.entry`). RoPE is applied to q
        and every k in one pass over their concatenated heads: the same numbers, but one swap, multiply and
        multiply-add per step instead of one per tensor (the chunked training step is bound by the number of
        kernels it launches). RoPE runs in the projections' [B, c, heads, hd] layout: q keeps it, and SDPA's
        output follows q's layout, so `output` reshapes it without a copy."""
        b, c, _ = a.shape
        q = self.q_proj(a).view(b, c, self.num_heads, self.head_dim)
        # several inputs (phase 1: a_t for the base entries, h_t for MELT's) go through kv_proj as one [B, n c, d]
        # product: one matrix product for all of them, and one weight gradient instead of n
        h = kv_inputs[0] if len(kv_inputs) == 1 else torch.cat(kv_inputs, dim=1)
        keys, values = self._keys_values(h)
        ks = keys.split(c, dim=1)
        vs = [v.transpose(1, 2) for v in values.split(c, dim=1)]
        rotated = apply_rope(torch.cat([q, *ks], dim=2), cos.transpose(1, 2), sin.transpose(1, 2))  # [B, c, H + n KVH, hd]
        q, *ks = (t.transpose(1, 2) for t in rotated.split([q.shape[2]] + [k.shape[2] for k in ks], dim=2))
        return q, [entry(k, v) for k, v in zip(ks, vs)]

    def output(self, heads: Tensor) -> Tensor:
        """o_proj of the attention heads [B, H, c, hd] -> [B, c, d]."""
        b, _, c, _ = heads.shape
        return self.o_proj(heads.transpose(1, 2).reshape(b, c, -1))


class LoopLMMLP(nn.Module):
    """down_proj(silu(gate_proj(x)) * up_proj(x)), with gate_proj and up_proj stored as one [2 I, d] weight
    (`gate_up_proj`): one matrix product each way and one weight gradient instead of two. Checkpoints keep
    the two tensors (`CHECKPOINT_LAYOUT`)."""

    def __init__(self, config: LoopLMConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LoopLMDecoderLayer(nn.Module):
    def __init__(self, config: LoopLMConfig) -> None:
        super().__init__()
        d, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = LoopLMAttention(config)
        self.mlp = LoopLMMLP(config)
        self.input_layernorm = RMSNorm(d, eps)
        self.input_layernorm_2 = RMSNorm(d, eps)
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.post_attention_layernorm_2 = RMSNorm(d, eps)

    def forward(self, part, *args):
        """One part of the layer's (layer, loop) step, `part(self, *args)` (layer_step.py). The model calls the parts
        directly; this forward lets torch.func.functional_call run one with stand-in weights
        (`layer_step._run_adding_grads`)."""
        return part(self, *args)

    def update_state(self, h_prev: Tensor, a: Tensor, loop: int, kv_sharing: str) -> tuple[Tensor, Tensor | None]:
        """Untrained KV sharing on a LoopLM: the shared entry updated through the fixed gate `last`
        (h_t = a_t) or `first` (h_t = a_1), by MELT's rule; no learned gate value to report."""
        h, _ = gate_update(_FIXED_GATES[kv_sharing], h_prev, a, loop)
        return h, None


_FIXED_GATES = {kind: FixedGate(kind) for kind in KV_SHARING if kind is not None}


class LoopLMModel(nn.Module):
    def __init__(self, config: LoopLMConfig, layer_cls=LoopLMDecoderLayer) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layer_cls(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Ouro's learned early-exit gate: used to stop only under --exit gate:Q; fitted by the exit-gate recipe
        # (docs/method.md#early-exit).
        self.early_exit_gate = nn.Linear(config.hidden_size, 1)
        self.rotary_emb = RotaryEmbedding(config)
        self.gradient_checkpointing = False  # re-run each (layer, loop) step in backward
        self.token_step = None  # compiled `token_step.token_chunk`, set by compile_token_step
        self.attention_inputs, self.attention_residual_and_mlp = attention_inputs, attention_residual_and_mlp
        self.layer_step_compiled = False
        self.captured_step = None  # (forward, backward) compiled whole, set by compile_captured_step
        self.grads_in_place = False  # set by compile_layer_step: the compiled parts add weight gradients into .grad
        self._working_weights: dict[nn.Parameter, tuple] = {}  # autocast-dtype copies for the compiled parts (`_stand_ins`)

    def run_chunk(
        self,
        input_ids: Tensor,
        position_ids: Tensor,
        policy,
        *,
        key_mask: Tensor | None = None,
        kv_sharing: str | None = None,
        collect: bool = False,
        collect_attn: bool | None = None,
    ) -> tuple[Tensor, dict]:
        """Run all T loops over one chunk of c tokens, attending through `policy`.

        input_ids, position_ids: [B, c]. key_mask: [B, >= past + c], True where a key slot
        holds a real token (generation over left-padded rows; None = no padding, and the
        chunk attends bottom-right causally without a mask tensor). Returns the last loop's
        normed hidden state [B, c, d] and, with collect=True, per-loop hidden states,
        attention outputs (unless collect_attn=False) and the gates' chunk means (`gate_mean`).
        """
        cfg = self.config
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(position_ids, compute_dtype(x))
        past = policy.past_length  # an int, or a device tensor [1] (a captured decode step: `DeviceAddressedKV`)
        mask = None if key_mask is None else self._mask(input_ids.shape[1], past, key_mask, x.device, compute_dtype(x))
        T, N = cfg.total_ut_steps, len(self.layers)
        states: list[Tensor | None] = [None] * N  # per-layer latent state h (shared-KV variants)
        checkpointed = self.gradient_checkpointing and torch.is_grad_enabled()
        loop_hidden, attn_outputs, gates = [], [[] for _ in range(N)], [[] for _ in range(N)]
        keep_o = collect if collect_attn is None else collect_attn  # else the step does not output o at all
        mix_weight = getattr(policy, "alpha", None)  # phase 1: the chunk's entries are interpolated inside the step
        captured = captured_step.applies(self, policy, mask)
        if captured:  # the chunk's start on the device: every chunk runs the same captured graphs
            start = torch.tensor(past, device=x.device)
            checkpointed = False  # a captured step keeps only its inputs, and recomputes in its backward
        if mix_weight is not None and (self.layer_step_compiled or captured):
            # compiled: alpha as a tensor, or each step's new alpha would compile the step again
            mix_weight = torch.tensor(mix_weight, dtype=torch.promote_types(compute_dtype(x), torch.float32), device=x.device)
        for t in range(T):
            for i, layer in enumerate(self.layers):
                args = (layer, i, t, policy, past, policy.store.token if hasattr(policy, "store") else None, mask, kv_sharing,
                        mix_weight, keep_o)
                if captured:
                    x, states[i], o, z, base, melt = captured_step.run(self, x, states[i], cos, sin, layer, i, t, policy,
                                                                        start, kv_sharing, mix_weight, keep_o)
                elif checkpointed:
                    x, states[i], o, z, base, melt = checkpoint(self._layer_step, x, states[i], cos, sin, *args, use_reentrant=False)
                else:
                    x, states[i], o, z, base, melt = self._layer_step(x, states[i], cos, sin, *args)
                policy.record(i, t, base, melt)
                if keep_o:
                    attn_outputs[i].append(o)
                if collect and policy.needs_melt:
                    gates[i].append(gate_mean(z))
            # x is normed by the loop's last layer step (`_layer_step`): the next loop's input, and this loop's
            # prediction state
            if collect:
                loop_hidden.append(x)
        policy.advance(input_ids.shape[1])
        return x, {"loop_hidden": loop_hidden, "attn_outputs": attn_outputs, "gates": gates}

    def _layer_step(self, x, h_prev, cos, sin, layer, i, t, policy, past, token, mask, kv_sharing, mix_weight, keep_o):
        """One layer at loop t over the chunk: a pure function of (x, h_{t-1}), so activation
        checkpointing can re-run it; its only side effect is rewriting the chunk's own slots.

        The parts before and after the attention are pure tensor code (`attention_inputs`,
        `attention_residual_and_mlp`), which `compile_layer_step` hands to torch.compile; the
        attention itself reads and writes the KV store, so it stays eager between them."""
        if self.grads_in_place and torch.is_grad_enabled():
            (before, after), with_grads = self._parts_adding_grads, (self._stand_ins(layer, compute_dtype(x)),)
        else:
            before, after, with_grads = self.attention_inputs, self.attention_residual_and_mlp, ()
        q, base, melt, h, z, mixed, residual = before(
            layer, *with_grads, x, h_prev, cos, sin, t == 0, t + 1, policy.needs_base, policy.needs_melt, kv_sharing,
            mix_weight, t == self.config.total_ut_steps - 1,
        )
        key, kv = policy.key_value(i, t, base, melt, mixed)
        # the loop's last layer applies the model's norm, within the step so that a compiled step fuses it
        final_norm = self.norm if i == len(self.layers) - 1 else None
        x, o = after(layer, *with_grads, residual, policy.attend(key, q, kv, past, token, mask), keep_o, final_norm)
        return x, h, o, z, base, melt

    def _stand_ins(self, layer, dtype: torch.dtype) -> dict[str, tuple[Tensor, Tensor]]:
        """For each of the layer's trainable weights, (what the compiled parts compute with, its `.grad`), for
        `layer_step._run_adding_grads`.

        `.grad` is allocated as zeros where the optimizer set it to None; the compiled backward adds into it, and
        the optimizer and clipping read it as usual. Under autocast a matrix weight is computed with in
        autocast's dtype: a copy cast once per optimizer step (when the weight's version moves), held in
        `_working_weights`, instead of a cast inside every compiled (chunk, loop) step and its recompute. It is
        autocast's own cast, bit for bit; for the eager step autocast's cache does the same
        (`training.step.weight_casts_kept`). fp32 weights (no autocast), norms and biases are used as they are."""
        stand_ins = {}
        for name, p in layer.named_parameters():
            if not p.requires_grad:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            weight = p
            if p.dim() == 2 and p.dtype != dtype:
                version = (p._version, p.data_ptr(), dtype)
                held = self._working_weights.get(p)
                if held is None or held[0] != version:
                    held = self._working_weights[p] = (version, p.detach().to(dtype).requires_grad_())
                weight = held[1]
            stand_ins[name] = (weight, p.grad)
        return stand_ins

    def compile_layer_step(self, grads_in_place: bool = True, **compile_kwargs) -> None:
        """torch.compile the pure parts of every (layer, loop) step: norms, projections, RoPE,
        the MELT gate, residuals and the MLP fuse into a few kernels per step, which is what
        chunk-wise training pays per chunk. Layers share compiled code. Shapes are static (dynamic
        shapes measured slower, docs/results/2026-11-26-benchmarks.md#compiled-layer-step): each new chunk
        shape compiles once, so training pads rows to whole chunks (`bucket(pad_multiple=C)`).

        grads_in_place: the compiled backward adds each layer weight's gradient into its `.grad` in place, in its
        own kernels, where autograd would sum a weight's N T chunk uses one kernel each. The gradients never pass
        through autograd's accumulation, so DDP and FSDP, which hook it, need grads_in_place=False."""
        compile_kwargs.setdefault("dynamic", False)
        self.attention_inputs = torch.compile(attention_inputs, **compile_kwargs)
        self.attention_residual_and_mlp = torch.compile(attention_residual_and_mlp, **compile_kwargs)
        self._parts_adding_grads = (torch.compile(attention_inputs_adding_grads, **compile_kwargs),
                                    torch.compile(attention_residual_and_mlp_adding_grads, **compile_kwargs))
        self.grads_in_place = grads_in_place
        self.layer_step_compiled = True

    def compile_captured_step(self, cuda_graphs: bool = False, **compile_kwargs) -> None:
        """Train with every (layer, loop) step as two whole graphs, its forward and its recompute with backward,
        attention included (`captured_step.py`), compiled with fullgraph=True; no graph depends on the chunk's
        index. Each step attends over its key's whole store (a dynamic size: any padded length runs the same
        graphs) under a mask from the chunk's device-side start. The weights' gradients are added into .grad in
        place (as `compile_layer_step(grads_in_place=True)`): one process only.

        cuda_graphs: on CUDA, replay the graphs as CUDA graphs (`mode="reduce-overhead"`). Off by default until
        a GPU has measured it: a step runs N T times per chunk with its outputs alive, which CUDA graph trees
        record as separate graphs, and the backward adds into .grad in place, which they may run uncaptured
        (benchmarks/gpu.py --only phase1_step_captured,phase1_step_captured_graphed measures both)."""
        options = {"fullgraph": True, "dynamic": False, **compile_kwargs}
        if cuda_graphs and next(self.parameters()).device.type == "cuda":
            options.setdefault("mode", "reduce-overhead")
        self.captured_step = (torch.compile(captured_step.step_forward, **options),
                              torch.compile(captured_step.step_backward, **options))

    def compile_token_step(self, **compile_kwargs) -> None:
        """Train MELT at chunk 1 with one torch.compile'd function per token (`token_step.py`): every loop
        and layer of a token, its attention included, in a few kernels. Only for short sequences: it
        keeps a padded copy of the earlier tokens' entries per token (O(L^2) memory)."""
        compile_kwargs.setdefault("dynamic", False)
        self.token_step = torch.compile(token_step.token_chunk, **compile_kwargs)

    @staticmethod
    def _mask(c: int, past: int | Tensor, key_mask: Tensor, device, dtype: torch.dtype = torch.float32) -> Tensor:
        """Additive mask [B, 1, c, past + c] for padded generation rows (0 where a query may attend, -inf
        elsewhere): earlier real tokens, and the chunk causally. Additive rather than boolean, because SDPA turns a
        boolean mask into this one at every call, three more ops at every (layer, loop).

        `past` a device tensor [1] (one token, c = 1, at that column, `DeviceAddressedKV`): [B, 1, 1, S] over the
        whole static capacity S = key_mask's columns, every real key up to the column; built from device values
        only, so a compiled step neither recompiles nor syncs as the column moves."""
        if isinstance(past, Tensor):
            allowed = key_mask.bool() & (torch.arange(key_mask.shape[1], device=device) <= past)  # [B, S]
            return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))[:, None, None]
        s = past + c
        q_pos = torch.arange(c, device=device)[:, None] + past
        allowed = torch.arange(s, device=device)[None, :] <= q_pos  # [c, s]
        allowed = allowed[None] & key_mask[:, None, :s].bool()
        # every query may attend to itself, so a padded query row never sees an empty key set
        own = torch.zeros(c, s, dtype=torch.bool, device=device)
        own[torch.arange(c), past + torch.arange(c)] = True
        allowed = (allowed | own)[:, None]
        return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))


def _join(pieces: list[Tensor]) -> Tensor:
    """Per-chunk pieces [B, c, ...] -> [B, L, ...], emptying the list so the pieces are freed one tensor at a
    time (N x T attention outputs would otherwise exist twice at the peak); a single piece is not copied."""
    joined = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)
    pieces.clear()
    return joined


class LoopLMPreTrainedModel(PreTrainedModel):
    config_class = LoopLMConfig
    base_model_prefix = "model"
    _no_split_modules = ["LoopLMDecoderLayer"]
    _supports_sdpa = True

    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)
        elif isinstance(module, RotaryEmbedding):
            module.inv_freq.copy_(rope_inv_freq(self.config))


class LoopLMForCausalLM(LoopLMPreTrainedModel):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    layer_cls = LoopLMDecoderLayer

    def __init__(self, config: LoopLMConfig) -> None:
        super().__init__(config)
        self.model = LoopLMModel(config, self.layer_cls)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def cache_layout(self, *, kv_sharing: str | None = None, share_prompt: bool = True) -> CacheLayout:
        """This model's cache with these options (a teacher-forced pass shares the prompt like every token)."""
        return layout_of(self.config, kv_sharing=kv_sharing, share_prompt=share_prompt and kv_sharing is not None)

    def make_policy(self, store, *, alpha: float = 1.0, kv_sharing: str | None = None):
        """The attention rule of this model's cache layout over `store`."""
        return policy_for(self.cache_layout(kv_sharing=kv_sharing), store, alpha=alpha)

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        chunk_size: int | None = None,
        first_chunk: int = 0,
        alpha: float = 1.0,
        output_loop_states: bool = False,
        kv_sharing: str | None = None,
        labels: Tensor | None = None,
        compute_logits: bool = True,
        output_attn_outputs: bool | None = None,
        loss_fn=None,
        exit_loops: Tensor | None = None,
        **kwargs,
    ) -> LoopLMOutput:
        """Teacher-forced forward over [B, L] tokens, chunk by chunk (docs/method.md#chunks).

        chunk_size None means the model's exact rule: one chunk for Ouro (its per-loop cache
        makes chunking irrelevant), one token per chunk where keys/values are shared across
        loops (MELT, kv_sharing). `first_chunk` > 0 makes the first that many tokens one chunk (a
        prompt, prefilled whole as vLLM does) and chunks of chunk_size follow it. Padding goes on
        the right (chunks count from column 0): real tokens never see a pad, so no mask is needed.
        compute_logits=False leaves the [B, L, V] logits to the caller (training computes them
        block by block from `hidden_states`/`last_hidden_state`); output_attn_outputs defaults
        to output_loop_states.
        loss_fn(lm_head, output) -> LossTerms is evaluated inside forward, where wrappers such as
        FSDP and autocast are active (training's objective); it fills `loss` and `loss_terms`.
        exit_loops [B, L] (long, 1..T; shared caches at alpha 1 only): the loop after which each token's shared
        entry stops changing, as `--exit` leaves an exited token's entry for later tokens (exit-aware training,
        docs/method.md#exit-aware-fine-tuning); every token still runs all T loops for its own outputs.
        """
        layout = self.cache_layout(kv_sharing=kv_sharing)
        policy = policy_for(layout, TrainingKVBuffer(input_ids.shape[1]), alpha=alpha, exit_loops=exit_loops)
        B, L = input_ids.shape
        if chunk_size is None:
            chunk_size = 1 if layout.prefill_chunk_matters else L
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        if first_chunk < 0:
            raise ValueError(f"first_chunk must be >= 0, got {first_chunk}")
        if attention_mask is not None:
            m = attention_mask.bool()
            if (m[:, 1:] & ~m[:, :-1]).any():
                raise ValueError("attention_mask must be right-padded (ones, then zeros) in a teacher-forced forward")
        if exit_loops is not None and tuple(exit_loops.shape) != (B, L):
            raise ValueError(f"exit_loops must be [B, L] = {[B, L]} like input_ids, got {list(exit_loops.shape)}")
        position_ids = torch.arange(L, device=input_ids.device).expand(B, L)
        collect_attn = output_loop_states if output_attn_outputs is None else output_attn_outputs
        T, N = self.config.total_ut_steps, self.config.num_hidden_layers
        hidden, loop_hidden = [], [[] for _ in range(T)]
        attn_outputs = [[[] for _ in range(T)] for _ in range(N)]
        gates = [[[] for _ in range(T)] for _ in range(N)]
        first = min(first_chunk, L)
        starts = ([0] if first else []) + list(range(first, L, chunk_size))
        # compile_token_step: one compiled call per token (it keeps every final entry: not with exit_loops)
        if exit_loops is None and token_step.applies(self, layout, chunk_size):
            chunks = token_step.token_steps(self.model, input_ids, position_ids, first, policy)
        else:
            chunks = (self.model.run_chunk(input_ids[:, start:end], position_ids[:, start:end], policy,
                                           kv_sharing=kv_sharing, collect=output_loop_states or collect_attn,
                                           collect_attn=collect_attn)
                      for start, end in zip(starts, starts[1:] + [L]))
        try:
            for x, extra in chunks:
                hidden.append(x)
                if output_loop_states or collect_attn:
                    for t in range(T):
                        loop_hidden[t].append(extra["loop_hidden"][t])
                        for i in range(N):
                            if collect_attn:
                                attn_outputs[i][t].append(extra["attn_outputs"][i][t])
                    for i in range(N):
                        for t, z in enumerate(extra["gates"][i]):
                            if z is not None:
                                gates[i][t].append(z)
        finally:
            # The store's latest commit token links it to the graph whose nodes hold the store: a reference
            # cycle through autograd's C++ nodes that Python's collector cannot free (each step leaked its
            # buffers). Broken on every exit, an exception mid-forward included.
            if hasattr(policy, "store"):
                policy.store.token = None
        last = _join(hidden)
        out = LoopLMOutput(last_hidden_state=last)
        if output_loop_states:
            out.hidden_states = [_join(h) for h in loop_hidden[:-1]] + [last]
            out.gate_means = self._gate_means(gates)
        if collect_attn:
            out.attn_outputs = [[_join(o) for o in per_loop] for per_loop in attn_outputs]
        if compute_logits:
            out.logits = self.lm_head(last)
            if output_loop_states:
                out.loop_logits = [self.lm_head(h) for h in out.hidden_states[:-1]] + [out.logits]
        if labels is not None:
            logits = out.logits if compute_logits else self.lm_head(last)
            out.loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        if loss_fn is not None:
            out.loss_terms = loss_fn(self.lm_head, out)
            out.loss = out.loss_terms.total
            # consumed: N x T tensors [B, L, d] that a wrapper would otherwise copy (Accelerate converts every
            # output to fp32 under mixed precision) and keep alive until the caller drops the output
            out.attn_outputs = None
        return out

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None) -> None:
        """Re-run each (layer, loop) step in backward: per token and (layer, loop), only the
        step's input x and state h are kept (HF's name for it)."""
        self.model.gradient_checkpointing = True

    def gradient_checkpointing_disable(self) -> None:
        self.model.gradient_checkpointing = False

    @property
    def is_gradient_checkpointing(self) -> bool:
        return self.model.gradient_checkpointing

    @staticmethod
    def _gate_means(gates) -> Tensor | None:
        """[N, T] mean z per layer and loop (the mean of each chunk's mean), NaN where none was recorded. Stays
        on the gates' device: reading it (`.tolist()`) is the caller's one host sync, once per logging step."""
        if not any(z for per_layer in gates for z in per_layer):
            return None
        if any(isinstance(z, Tensor) and z.is_meta for per_layer in gates for zs in per_layer for z in zs):
            return None  # shapes only (a memory projection on the meta device)
        device = next((z.device for per_layer in gates for zs in per_layer for z in zs if isinstance(z, Tensor)), "cpu")
        nan = torch.full((), float("nan"), device=device)
        # each z is already its chunk's mean (`layer_step.gate_mean`): a 0-dim fp32 tensor or a float
        means = [torch.stack([torch.as_tensor(z, dtype=torch.float32, device=device) for z in zs]).mean() if zs
                 else nan for per_layer in gates for zs in per_layer]
        return torch.stack(means).view(len(gates), len(gates[0]))

    @torch.no_grad()
    def early_exit_probabilities(self, input_ids: Tensor) -> Tensor:
        """Per-loop exit probability sigmoid(early_exit_gate(norm(h_t))), [T, B, L].

        The engine stops on these under `--exit gate:Q` (modeling/early_exit.py, which owns `exit_logit`)."""
        from melt_eval.modeling.early_exit import exit_logit

        out = self(input_ids, output_loop_states=True)
        return torch.stack([torch.sigmoid(exit_logit(self, h)) for h in out.hidden_states])


# Checkpoints keep Ouro's and MELT's tensors: k_proj and v_proj, gate_proj and up_proj, MELT's a_proj and h_proj
# apart. Loading concatenates each pair into the merged weight (k's or gate's rows first; a_proj's columns first),
# along the dim given, and save_pretrained splits it back in halves (transformers reverses the mapping on save), so
# the Hub layout is what every checkpoint, loaded or written, holds.
CHECKPOINT_LAYOUT = (
    ("self_attn.kv_proj.weight", ["self_attn.k_proj.weight", "self_attn.v_proj.weight"], 0),
    ("mlp.gate_up_proj.weight", ["mlp.gate_proj.weight", "mlp.up_proj.weight"], 0),
    ("melt_gate.ah_proj.weight", ["melt_gate.a_proj.weight", "melt_gate.h_proj.weight"], 1),
)


def checkpoint_parts(key: str) -> tuple[list[str], int]:
    """The checkpoint's names for a model tensor and the dim along which they are concatenated in it: a merged
    weight's two (`CHECKPOINT_LAYOUT`), else its own (dim 0)."""
    for merged, sources, dim in CHECKPOINT_LAYOUT:
        if key.endswith(merged):
            return [key[: -len(merged)] + source for source in sources], dim
    return [key], 0


def checkpoint_names(key: str) -> list[str]:
    """The checkpoint's names for a model tensor: a merged weight's two (`CHECKPOINT_LAYOUT`), else its own."""
    return checkpoint_parts(key)[0]


def register_checkpoint_layout(model_type: str) -> None:
    register_checkpoint_conversion_mapping(model_type, [
        WeightConverter(source_patterns=sources, target_patterns=merged, operations=[Concatenate(dim=dim)])
        for merged, sources, dim in CHECKPOINT_LAYOUT
    ], overwrite=True)


register_checkpoint_layout("ouro")
# transformers' Auto classes load "ouro" checkpoints with this class (no remote code), from wherever it is imported
AutoConfig.register("ouro", LoopLMConfig, exist_ok=True)
AutoModelForCausalLM.register(LoopLMConfig, LoopLMForCausalLM, exist_ok=True)
