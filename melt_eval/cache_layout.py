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

from dataclasses import dataclass, replace

from melt_eval.errors import UserError

LOOPED = ("ouro", "melt")
KV_SHARING = (None, "first", "last")  # Ouro's untrained sharing: the fixed gate of its shared cache
LAYOUTS = ("per_loop", "shared", "generated_shared", "single")
BF16_BYTES = 2
# vLLM `--hf-overrides` keys the plugin reads (vLLM passes the config on, not the harness's options)
KV_SHARING_KEY = "melt_eval_kv_sharing"
PREFILL_CHUNK_KEY = "melt_eval_prefill_chunk"


# Quantized caches (docs/method.md#quantized-caches): KIVI's scheme (Liu et al., 2024). Keys are quantized per
# channel over groups of KV_GROUP tokens, values per token over groups of KV_GROUP channels, each group with a
# scale and a minimum in KV_SCALE_BYTES (16-bit: the model's dtype when it is 16-bit, else bfloat16, so a float32
# model's int4 cache is not half scales); fp8 (e4m3) casts each value, no scales. The last KV_RESIDUAL
# committed tokens stay in full precision (a window of up to KV_RESIDUAL + KV_GROUP - 1 tokens: a key group is
# quantized once all its KV_GROUP tokens are older than the window). "auto": the model's dtype, unquantized.
KV_CACHE_DTYPES = ("auto", "fp8", "int8", "int4")
KV_BITS = {"fp8": 8, "int8": 8, "int4": 4}
KV_GROUP = 32
KV_RESIDUAL = 32
KV_SCALE_BYTES = 2
CROSS_LOOP = "cross-loop"  # Ouro's training-free cross-loop cache (FlashLoop-style): loop 1 full, later loops int4 deltas


def check_kv_cache_dtype(value, flag: str = "--kv-cache-dtype") -> None:
    if value not in KV_CACHE_DTYPES:
        raise LayoutError(f"{flag} must be {' | '.join(KV_CACHE_DTYPES)}, got {value!r}")


@dataclass(frozen=True)
class KVQuant:
    """How one store key's K and V are kept: `dtype` (KV_CACHE_DTYPES) with KIVI's group and window.

    `bytes_for(tokens, head_dim, kv_heads, bytes_per_value)` is the exact size of the tensors the native
    engine's quantized store allocates for a capacity of `tokens` (K and V of one key)."""

    dtype: str = "auto"
    group: int = KV_GROUP
    residual: int = KV_RESIDUAL

    @property
    def quantized(self) -> bool:
        return self.dtype != "auto"

    @property
    def window(self) -> int:
        """Full-precision tokens kept per key (the recent window and the group being filled)."""
        return self.residual + self.group - 1

    def quantized_tokens(self, length: int) -> int:
        """Tokens of a sequence of `length` held quantized: whole groups older than the residual window."""
        return max(0, (length - self.residual) // self.group) * self.group

    def code_bytes(self, head_dim: int) -> int:
        """Bytes of one token's codes for K (or V) on one head: head_dim values at KV_BITS bits."""
        return head_dim * KV_BITS[self.dtype] // 8

    def scale_values(self, head_dim: int) -> int:
        """Scale + minimum values per token and head for K (or V): 2 x head_dim / group (keys: one pair per
        channel per `group` tokens; values: one pair per token per `group` channels); fp8 has none."""
        return 0 if self.dtype == "fp8" else 2 * head_dim // self.group

    def bytes_per_token(self, head_dim: int, kv_heads: int, bytes_per_value: int = BF16_BYTES) -> int:
        """K and V bytes of one quantized token on one key (the asymptotic per-token cost); `bytes_per_value`
        (the model's dtype) prices unquantized entries, the scales are KV_SCALE_BYTES whatever the model's."""
        if not self.quantized:
            return 2 * kv_heads * head_dim * bytes_per_value
        return 2 * kv_heads * (self.code_bytes(head_dim) + self.scale_values(head_dim) * KV_SCALE_BYTES)

    def bytes_for(self, tokens: int, head_dim: int, kv_heads: int, bytes_per_value: int = BF16_BYTES) -> int:
        """K and V bytes allocated for a capacity of `tokens` on one key: quantized groups plus the window."""
        if not self.quantized:
            return tokens * self.bytes_per_token(head_dim, kv_heads, bytes_per_value)
        full = 2 * kv_heads * head_dim * bytes_per_value
        return (self.quantized_tokens(tokens) * self.bytes_per_token(head_dim, kv_heads, bytes_per_value)
                + self.window_for(tokens) * full)

    def window_for(self, capacity: int) -> int:
        """Window tokens allocated for a capacity: at most `window` are ever unquantized, and never more than the capacity."""
        return min(self.window, capacity)

    def check_head_dim(self, head_dim: int) -> None:
        if self.quantized and self.dtype != "fp8" and head_dim % self.group:
            raise LayoutError(f"--kv-cache-dtype {self.dtype} groups channels by {self.group}; this model's head_dim "
                              f"{head_dim} is not a multiple of it")


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
    quant: KVQuant = KVQuant()  # how each entry is stored (--kv-cache-dtype)
    cross_loop: bool = False  # Ouro's per-loop cache with loops 2..T as int4 deltas from loop 1 (--cross-loop-kv)

    @property
    def compressed(self) -> bool:
        """Whether the engine keeps this cache in a quantized store (`melt_eval.modeling.kv_quant`)."""
        return self.quant.quantized or self.cross_loop

    def key_quant(self, key) -> KVQuant:
        """How one store key is kept: the run's dtype, or for the cross-loop cache loop 1 full and later loops int4."""
        if self.cross_loop:
            return KVQuant("int4") if key[1] > 0 else KVQuant()
        return self.quant

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
        if self.compressed:  # the quantized store: each key's groups and window, for P + G tokens
            keys = self.store_keys()[0]
            return sum(self.key_quant(key).bytes_for(prompt_tokens + generated_tokens, self.head_dim, self.kv_heads,
                                                     bytes_per_value) for key in keys)
        prompt, generated = self.entries_per_token()
        entries = self.layers * (prompt * prompt_tokens + generated * generated_tokens)
        return 2 * entries * self.kv_heads * self.head_dim * bytes_per_value

    def bytes_per_token(self, bytes_per_value: int = BF16_BYTES) -> int:
        """Bytes per generated token (the memory table's and the registry's figure); for a quantized cache the
        per-token cost of its quantized groups (codes + scales), the window being a fixed cost per key."""
        if self.compressed:
            return sum(self.key_quant(key).bytes_per_token(self.head_dim, self.kv_heads, bytes_per_value)
                       for key in self.store_keys()[0])
        return self.nbytes(0, 1, bytes_per_value)

    def describe(self) -> str:
        if self.shares_across_loops and not self.prompt_shared:
            return f"{self.loops} loops x {self.layers} layers for the prompt, {self.layers} layers shared across loops after it"
        if self.cross_loop:
            return f"{self.loops} loops x {self.layers} layers, loops 2..{self.loops} as int4 deltas from loop 1"
        if self.quant.quantized:
            return f"{replace(self, quant=KVQuant()).describe()}, {self.quant.dtype}"
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
        if self.cross_loop:
            raise LayoutError("--cross-loop-kv runs on --backend native only")
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
        if share_prompt:  # it would change nothing, but be recorded as if it had
            raise LayoutError("--share-prompt goes with Ouro's --kv-sharing; MELT shares every entry across its loops, "
                              "the prompt's too: drop --share-prompt")
        return CacheLayout("shared", loops, layers, kv_heads, head_dim, gate=gate or "elementwise")
    if kv_sharing is None:
        if share_prompt:
            raise LayoutError("--share-prompt goes with --kv-sharing (it shares the prompt's cache across loops too)")
        return CacheLayout("per_loop", loops, layers, kv_heads, head_dim)
    kind = "shared" if share_prompt else "generated_shared"
    return CacheLayout(kind, loops, layers, kv_heads, head_dim, gate=kv_sharing)


def compressed_layout(layout: CacheLayout, kv_cache_dtype: str = "auto", cross_loop: bool = False) -> CacheLayout:
    """`layout` stored quantized (--kv-cache-dtype) or as Ouro's cross-loop deltas (--cross-loop-kv); the one
    error for a combination the quantized store does not take."""
    check_kv_cache_dtype(kv_cache_dtype)
    quant = KVQuant(kv_cache_dtype)
    if cross_loop:
        if layout.kind != "per_loop" or layout.loops < 2:
            raise LayoutError("--cross-loop-kv compresses Ouro's per-loop cache (loops >= 2, no --kv-sharing); "
                              f"this run's cache holds {layout.describe()}")
        if quant.quantized:
            raise LayoutError("--cross-loop-kv keeps loop 1 in the model's dtype; leave --kv-cache-dtype auto")
        KVQuant("int4").check_head_dim(layout.head_dim)
        return replace(layout, cross_loop=True)
    if not quant.quantized:
        return layout
    if layout.kind == "generated_shared":
        raise LayoutError("--kv-cache-dtype applies to one-store caches; the 'w/ prefill' KV sharing keeps two, "
                          "pass --share-prompt or leave --kv-cache-dtype auto")
    quant.check_head_dim(layout.head_dim)
    return replace(layout, quant=quant)


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
