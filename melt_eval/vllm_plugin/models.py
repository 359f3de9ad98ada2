"""The Ouro LoopLM and MELT as vLLM models (MELT.md sections 1 and 2).

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

Parameter names are the checkpoints' own (`model.layers.{i}.self_attn.q_proj.weight`,
`model.layers.{i}.melt_gate.a_proj.weight`, ...), so weights load by name, one to one. The
attention modules live at `model.attn.{k}` (k = t*N + i for Ouro's per-loop caches, k = i
for shared ones) because vLLM orders its caches by the one integer in that name.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.attention import Attention

from melt_eval.modeling.looplm import RMSNorm
from melt_eval.modeling.melt import LEARNED_GATES

Tensor = torch.Tensor

# hf_overrides key the harness sets to run Ouro with untrained KV sharing
KV_SHARING_KEY = "melt_eval_kv_sharing"


class Linear(nn.Linear):
    """nn.Linear without random initialisation: every weight comes from the checkpoint."""

    def reset_parameters(self) -> None:
        pass


class Rope:
    """RoPE, Hugging Face Llama's rotate-half convention, on flat [tokens, heads * head_dim]."""

    def __init__(self, head_dim: int, theta: float, positions: Tensor, dtype: torch.dtype) -> None:
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim))
        freqs = positions[:, None].float() * inv_freq  # [L, hd/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos, self.sin = emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]  # [L, 1, hd]
        self.head_dim = head_dim

    def __call__(self, x: Tensor) -> Tensor:
        shape = x.shape
        x = x.view(shape[0], -1, self.head_dim)
        x1, x2 = x.chunk(2, dim=-1)
        return (x * self.cos + torch.cat([-x2, x1], dim=-1) * self.sin).reshape(shape)


class Gate(nn.Module):
    """MELT's z_t; for `elementwise`/`scalar` the checkpoint's `melt_gate.{a_proj,h_proj,bias}`."""

    def __init__(self, kind: str, hidden_size: int, ema_decay: float) -> None:
        super().__init__()
        self.kind, self.ema_decay = kind, ema_decay
        if kind in LEARNED_GATES:
            out = hidden_size if kind == "elementwise" else 1
            self.a_proj = Linear(hidden_size, out, bias=False)
            self.h_proj = Linear(hidden_size, out, bias=False)
            self.bias = nn.Parameter(torch.empty(out))

    def update(self, h_prev: Tensor, a: Tensor, loop: int) -> Tensor:
        """h_t = z_t * h_{t-1} + (1 - z_t) * a_t for loop t >= 2."""
        if self.kind in LEARNED_GATES:
            z = torch.sigmoid(self.a_proj(a) + self.h_proj(h_prev) + self.bias)
        else:
            z = {"ema": self.ema_decay, "mean": (loop - 1) / loop, "last": 0.0, "first": 1.0}[self.kind]
        return z * h_prev + (1 - z) * a


class MLP(nn.Module):
    def __init__(self, d: int, inter: int) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = Linear(d, inter, bias=False), Linear(d, inter, bias=False)
        self.down_proj = Linear(inter, d, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SelfAttention(nn.Module):
    """The projections only; the attention itself is one of `LoopedModel.attn`."""

    def __init__(self, config) -> None:
        super().__init__()
        d, hd = config.hidden_size, config.head_dim
        self.q_proj = Linear(d, config.num_attention_heads * hd, bias=False)
        self.k_proj = Linear(d, config.num_key_value_heads * hd, bias=False)
        self.v_proj = Linear(d, config.num_key_value_heads * hd, bias=False)
        self.o_proj = Linear(config.num_attention_heads * hd, d, bias=False)


class DecoderLayer(nn.Module):
    def __init__(self, config, gate: str | None) -> None:
        super().__init__()
        d, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = SelfAttention(config)
        self.mlp = MLP(d, config.intermediate_size)
        self.input_layernorm = RMSNorm(d, eps)
        self.input_layernorm_2 = RMSNorm(d, eps)
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.post_attention_layernorm_2 = RMSNorm(d, eps)
        if gate is not None:
            self.melt_gate = Gate(gate, d, getattr(config, "ema_decay", 0.2))


class LoopedModel(nn.Module):
    def __init__(self, vllm_config: VllmConfig, prefix: str, gate: str | None) -> None:
        """gate None: Ouro's per-loop caches; otherwise one shared cache per layer, state updated by `gate`."""
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config, self.shared = config, gate is not None
        T, N = config.total_ut_steps, config.num_hidden_layers
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, gate) for _ in range(N))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Ouro's learned early-exit gate: loaded (it is in every checkpoint), never used to stop.
        self.early_exit_gate = Linear(config.hidden_size, 1)
        hd = config.head_dim
        self.attn = nn.ModuleList(
            Attention(
                config.num_attention_heads, hd, hd**-0.5, num_kv_heads=config.num_key_value_heads,
                cache_config=vllm_config.cache_config, quant_config=None, prefix=f"{prefix}.attn.{k}",
            )
            for k in range(N if self.shared else T * N)
        )

    def forward(self, input_ids: Tensor | None, positions: Tensor, inputs_embeds: Tensor | None = None) -> Tensor:
        cfg = self.config
        x = inputs_embeds if inputs_embeds is not None else self.embed_tokens(input_ids)
        rope = Rope(cfg.head_dim, cfg.rope_theta, positions, x.dtype)
        T, N = cfg.total_ut_steps, len(self.layers)
        states: list[Tensor | None] = [None] * N  # per-layer latent state h (shared caches)
        for t in range(T):
            for i, layer in enumerate(self.layers):
                a = layer.input_layernorm(x)
                proj = layer.self_attn
                if not self.shared:
                    h, attn = a, self.attn[t * N + i]
                else:
                    # h_1 = a_1; h_t = z_t * h_{t-1} + (1 - z_t) * a_t
                    h = a if t == 0 else layer.melt_gate.update(states[i], a, t + 1)
                    states[i], attn = h, self.attn[i]
                o = proj.o_proj(attn(rope(proj.q_proj(a)), rope(proj.k_proj(h)), proj.v_proj(h)))
                x = x + layer.input_layernorm_2(o)
                x = x + layer.post_attention_layernorm_2(layer.mlp(layer.post_attention_layernorm(x)))
            x = self.norm(x)  # the next loop's input; after loop T, what the LM head reads
        return x


class _LoopedForCausalLM(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        self.model = LoopedModel(vllm_config, f"{prefix}.model" if prefix else "model", self.gate_kind(config))
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @staticmethod
    def gate_kind(config) -> str | None:
        raise NotImplementedError

    def embed_input_ids(self, input_ids: Tensor) -> Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids: Tensor | None, positions: Tensor, intermediate_tensors=None,
                inputs_embeds: Tensor | None = None, **kwargs) -> Tensor:
        return self.model(input_ids, positions, inputs_embeds)

    def compute_logits(self, hidden_states: Tensor) -> Tensor:
        return self.lm_head(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """Copy checkpoint tensors by name; an unknown name or a wrong shape is an error."""
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            if name not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in {type(self).__name__} "
                                 f"(gate {self.gate_kind(self.config)!r}); is config.json the checkpoint's own?")
            param = params[name]
            if param.shape != tensor.shape:
                raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, model expects {tuple(param.shape)}")
            with torch.no_grad():
                param.copy_(tensor)
            loaded.add(name)
        return loaded  # vLLM checks that every parameter was loaded


class OuroForCausalLM(_LoopedForCausalLM):
    """The Ouro LoopLM; with `melt_eval_kv_sharing` set, the untrained first/last-loop sharing."""

    @staticmethod
    def gate_kind(config) -> str | None:
        sharing = getattr(config, KV_SHARING_KEY, None)
        if sharing not in (None, "first", "last"):
            raise ValueError(f"kv_sharing must be None, 'first' or 'last', got {sharing!r}")
        return sharing


class MeltForCausalLM(_LoopedForCausalLM):
    """MELT with the checkpoint's gate (elementwise, scalar, ema, mean, last, first)."""

    @staticmethod
    def gate_kind(config) -> str | None:
        if getattr(config, KV_SHARING_KEY, None) is not None:
            raise ValueError("kv_sharing applies to LoopLM (Ouro) models; MELT always shares its KV cache")
        return config.gate
