"""How a model keeps its keys and values across loops: the one place that decides it (docs/method.md#caches).

The native engine's stores, the vLLM backend and plugin, `serve`, the memory table, the registry,
training's chunk rule and the compiled token step ask a `CacheLayout` instead of deciding
themselves. It imports nothing from the harness but its error type, so every layer can use it.

| layout              | who                                                | entries per token and layer |
|                     |                                                    | prompt     | generated      |
| ------------------- | -------------------------------------------------- | ---------- | -------------- |
| `per_loop`          | Ouro                                               | T          | T              |
| `shared`            | MELT; Ouro with `kv_sharing` and `share_prompt`    | 1          | 1              |
| `generated_shared`  | Ouro with `kv_sharing` ("w/ prefill" baselines)    | T          | 1              |
| `single`            | a model that does not loop                         | 1          | 1              |

A shared cache is written at every loop and read through a gate z_t (h_t = z h_{t-1} + (1 - z) a_t):
MELT's own gate, or for Ouro's untrained baselines the fixed gate `first` (z = 1) or `last` (z = 0).
A new layout (a quantized cache, fewer KV heads) is a new entry here plus its store.
"""

from __future__ import annotations

from dataclasses import dataclass

from melt_eval.errors import UserError

LOOPED = ("ouro", "melt")
KV_SHARING = (None, "first", "last")  # Ouro's untrained sharing: the fixed gate of its shared cache
LAYOUTS = ("per_loop", "shared", "generated_shared", "single")
BF16_BYTES = 2
# vLLM `--hf-overrides` keys the plugin reads (vLLM passes the config on, not the harness's options)
KV_SHARING_KEY = "melt_eval_kv_sharing"
PREFILL_CHUNK_KEY = "melt_eval_prefill_chunk"


class LayoutError(UserError, ValueError):
    """An inference option that does not fit the model's cache (one line; the CLI exits 2)."""


MELT_ALWAYS_SHARES = "--kv-sharing applies to LoopLM (Ouro) checkpoints only; MELT always shares its KV cache"


def check_kv_sharing(value, flag: str = "--kv-sharing") -> None:
    """The one check of a kv_sharing value: None (Ouro's per-loop cache) or the loop whose KV all loops share."""
    if value not in KV_SHARING:
        named = " or ".join(repr(v) for v in KV_SHARING if v is not None)
        raise LayoutError(f"{flag} must be {named}, got {value!r}")


@dataclass(frozen=True)
class CacheLayout:
    kind: str  # one of LAYOUTS
    loops: int  # T
    layers: int  # N
    kv_heads: int
    head_dim: int
    gate: str | None = None  # what a shared cache is updated by: MELT's gate kind, or Ouro's "first"/"last"

    @property
    def shares_across_loops(self) -> bool:
        """Whether generated tokens keep one entry per layer, rewritten at every loop."""
        return self.kind in ("shared", "generated_shared")

    @property
    def prompt_shared(self) -> bool:
        """Whether prompt tokens keep one entry per layer too (else T, one per loop)."""
        return self.kind == "shared"

    @property
    def prefill_chunk_matters(self) -> bool:
        """Where the prompt's entries are shared across loops, a token prefilled with others sees their
        loop-t entries rather than their final ones: the chunk C changes the result (C = 1 is exact MELT)."""
        return self.kind == "shared"

    def entries_per_token(self) -> tuple[int, int]:
        """Cache entries per token and layer: (prompt token, generated token)."""
        prompt = self.loops if self.kind in ("per_loop", "generated_shared") else 1
        generated = self.loops if self.kind == "per_loop" else 1
        return prompt, generated

    def nbytes(self, prompt_tokens: int, generated_tokens: int = 0, bytes_per_value: int = BF16_BYTES) -> int:
        """Bytes of K and V for one sequence: 2 x layers x entries x kv_heads x head_dim x bytes per value."""
        prompt, generated = self.entries_per_token()
        entries = self.layers * (prompt * prompt_tokens + generated * generated_tokens)
        return 2 * entries * self.kv_heads * self.head_dim * bytes_per_value

    def bytes_per_token(self, bytes_per_value: int = BF16_BYTES) -> int:
        """Bytes per generated token (the memory table's and the registry's figure)."""
        return self.nbytes(0, 1, bytes_per_value)

    def describe(self) -> str:
        if self.shares_across_loops and not self.prompt_shared:
            return f"{self.loops} loops x {self.layers} layers for the prompt, {self.layers} layers shared across loops after it"
        if self.kind == "per_loop":
            return f"{self.loops} loops x {self.layers} layers"
        return f"{self.layers} layers, shared across loops" if self.kind == "shared" else f"{self.layers} layers"

    def store_keys(self) -> tuple[list, list]:
        """The engine's store keys for (prompt, generated) tokens: (layer, loop) per loop, layer where shared."""
        per_loop = [(i, t) for t in range(self.loops) for i in range(self.layers)]
        shared = list(range(self.layers))
        return (shared if self.prompt_shared else per_loop), (per_loop if self.kind == "per_loop" else shared)

    def vllm_caches(self) -> int:
        """The attention caches vLLM allocates per layer stack: T x N per-loop ones or N shared ones."""
        if self.kind == "generated_shared":
            raise LayoutError("vLLM runs untrained KV sharing over the prompt too (--share-prompt); the 'w/ prefill' form, "
                              "which keeps Ouro's per-loop cache for the prompt, runs on --backend native only")
        return self.loops * self.layers if self.kind == "per_loop" else self.layers

    def vllm_overrides(self, kv_sharing: str | None, prefill_chunk: int | None) -> dict:
        """The `--hf-overrides` that tell the plugin this layout (the loop count is the config's own)."""
        self.vllm_caches()
        overrides = {}
        if kv_sharing is not None:
            overrides[KV_SHARING_KEY] = kv_sharing
        if self.prefill_chunk_matters and prefill_chunk is not None:
            overrides[PREFILL_CHUNK_KEY] = prefill_chunk
        return overrides


def cache_layout(model_type: str | None, *, loops: int, layers: int, kv_heads: int, head_dim: int,
                 gate: str | None = None, kv_sharing: str | None = None, share_prompt: bool = False) -> CacheLayout:
    """The layout of a model type ("ouro", "melt", anything else: not looped) with its inference options;
    the one error for a combination that does not exist."""
    check_kv_sharing(kv_sharing)
    looped = model_type in LOOPED
    if not looped:
        if kv_sharing or share_prompt:
            raise LayoutError("--kv-sharing and --share-prompt apply to LoopLM (Ouro) models only")
        return CacheLayout("single", 1, layers, kv_heads, head_dim)
    if model_type == "melt":
        if kv_sharing is not None:
            raise LayoutError(MELT_ALWAYS_SHARES)
        return CacheLayout("shared", loops, layers, kv_heads, head_dim, gate=gate or "elementwise")
    if kv_sharing is None:
        if share_prompt:
            raise LayoutError("--share-prompt goes with --kv-sharing (it shares the prompt's cache across loops too)")
        return CacheLayout("per_loop", loops, layers, kv_heads, head_dim)
    kind = "shared" if share_prompt else "generated_shared"
    return CacheLayout(kind, loops, layers, kv_heads, head_dim, gate=kv_sharing)


def layout_of(config, *, loops: int | None = None, kv_sharing: str | None = None, share_prompt: bool = False) -> CacheLayout:
    """`cache_layout` for a model config (a transformers config or a config.json dict); `loops` overrides T."""
    get = config.get if isinstance(config, dict) else (lambda key, default=None: getattr(config, key, default))
    model_type = get("model_type")
    heads = int(get("num_attention_heads"))
    head_dim = get("head_dim") or int(get("hidden_size")) // heads
    served = get(KV_SHARING_KEY)  # a config vLLM's plugin reads: its sharing covers the prompt too
    return cache_layout(model_type, loops=int(loops or get("total_ut_steps", 1) or 1), layers=int(get("num_hidden_layers")),
                        kv_heads=int(get("num_key_value_heads") or heads), head_dim=int(head_dim), gate=get("gate"),
                        kv_sharing=kv_sharing if kv_sharing is not None else served,
                        share_prompt=share_prompt or served is not None)
