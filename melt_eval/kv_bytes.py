"""Bytes of a KV cache (spec section 3): the one formula the registry, the memory table and the native
engine's cache budget use.

    bytes = 2 (K and V) x entries x num_kv_heads x head_dim x bytes per value
    entries = layers x tokens x T   a cache per loop (Ouro)
            = layers x tokens       one cache shared by the loops (MELT; Ouro with kv_sharing and share_prompt)
            = layers x (prompt x T + generated)   kv_sharing "w/ prefill": per-loop prompt, shared generated tokens

A leaf module (nothing of the harness imported), so the registry can use it without a cycle through
`melt_eval.modeling`, whose loader reads the registry.
"""

from __future__ import annotations

SHARING = ("per_loop", "shared", "generated")  # which tokens' entries the loops share: none, all, generated only
BF16_BYTES = 2


def kv_cache_bytes(*, layers: int, kv_heads: int, head_dim: int, tokens: int = 1, loops: int = 1,
                   sharing: str = "per_loop", prompt_tokens: int = 0, bytes_per_value: int = BF16_BYTES) -> int:
    """Bytes of K and V for `tokens` tokens (`prompt_tokens` of them the prompt, for sharing="generated")."""
    if sharing == "per_loop":
        entries = layers * tokens * loops
    elif sharing == "shared":
        entries = layers * tokens
    elif sharing == "generated":
        entries = layers * (prompt_tokens * loops + (tokens - prompt_tokens))
    else:
        raise ValueError(f"unknown KV sharing {sharing!r}; valid: {', '.join(SHARING)}")
    return 2 * entries * kv_heads * head_dim * bytes_per_value
