"""Native generation for LoopLM and MELT: batched incremental decoding with explicit caches.

Each prompt is prefilled on its own (chunked by `prefill_chunk_size` where the KV is
shared across loops, so the chunk rule is exactly MELT's), straight into its rows of
one batched, preallocated cache; then all prompts x samples decode together, one token
per step. The cache layout is right-aligned: prompt i fills columns
[P_max - P_i, P_max), generated tokens follow at P_max, P_max + 1, ...

Cache entries per token: Ouro T x N (one per loop and layer); MELT and the shared-KV
baselines N (the current token's slot is rewritten at every loop); the baselines
"w/ prefill" keep T x N for the prompt and N for generated tokens. `peak_cache_bytes`
is the size of the cache tensors actually allocated, measured with `Tensor.nbytes`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from melt_eval.modeling.kv_cache import PerLoopKV, PromptPerLoopThenSharedKV, SharedKV, StaticStore
from melt_eval.modeling.looplm import KV_SHARING, LoopLMForCausalLM
from melt_eval.modeling.melt import MeltForCausalLM

Tensor = torch.Tensor


@dataclass
class GenerationResult:
    sequences: list[list[list[int]]]  # [prompt][sample] -> generated token ids (EOS included)
    logprobs: list[list[list[float]]]  # same shape: log p(token) under the last loop, before sampling transforms
    peak_cache_bytes: int = 0
    num_generated_tokens: int = 0
    finish_reasons: list[list[str]] = field(default_factory=list)  # "stop" | "length"


def row_seed(prompt_seed: int, sample: int) -> int:
    """Seed of one (prompt, sample): independent of batching and of how many samples are drawn."""
    return (prompt_seed * 1_000_003 + sample * 7_919 + 12_345) % (2**63 - 1)


def sample_next(logits: Tensor, temperature: float, top_p: float, generators: Sequence[torch.Generator]) -> Tensor:
    """One token per row from [B, V] logits: greedy at temperature 0, else nucleus sampling."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the token crossing it included)
        drop = sorted_p.cumsum(-1) - sorted_p >= top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    return torch.stack([torch.multinomial(p, 1, generator=g)[0] for p, g in zip(probs, generators)])


class _Caches:
    """The batched cache for one generate() call and the policy that reads it."""

    def __init__(self, model, rows: int, p_max: int, max_new: int, kv_sharing, share_prompt, dtype, device):
        cfg = model.config
        T, N = cfg.total_ut_steps, cfg.num_hidden_layers
        dims = dict(batch=rows, kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, dtype=dtype, device=device)
        per_loop = [(i, t) for t in range(T) for i in range(N)]
        self.hybrid = kv_sharing is not None and not share_prompt
        if isinstance(model, MeltForCausalLM) or (kv_sharing and share_prompt):
            self.store = StaticStore(list(range(N)), capacity=p_max + max_new, **dims)
            self.stores = [self.store]
        elif self.hybrid:
            self.prompt_store = StaticStore(per_loop, capacity=p_max, **dims)
            self.gen_store = StaticStore(list(range(N)), capacity=max_new, **dims)
            self.stores = [self.prompt_store, self.gen_store]
        else:
            self.store = StaticStore(per_loop, capacity=p_max + max_new, **dims)
            self.stores = [self.store]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.stores)

    def prefill_policy(self, model, rows: slice, start: int, kv_sharing):
        """Policy writing one prompt into its rows, from column `start`."""
        if self.hybrid:
            return PerLoopKV(StaticStore.view_of(self.prompt_store, rows, start))
        return model.make_policy(StaticStore.view_of(self.store, rows, start), kv_sharing=kv_sharing)

    def decode_policy(self, model, kv_sharing):
        if self.hybrid:
            return PromptPerLoopThenSharedKV(self.prompt_store, self.gen_store)
        return model.make_policy(self.store, kv_sharing=kv_sharing)

    def replicate(self, src: int, dst: slice) -> None:
        for s in self.stores:
            s.copy_rows(src, dst)


# cuDNN's attention builds a new execution plan per call when the key length keeps changing,
# which on an H100 cost ~4 ms of host time per call for the LoopLM's T x N cache buffers
# (profiled: 70% of decode time); the other fused kernels do not, so decoding leaves it out.
_DECODE_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@torch.no_grad()
@sdpa_kernel(_DECODE_ATTENTION)
def generate(
    model: LoopLMForCausalLM,
    prompts: Sequence[Sequence[int]],
    *,
    n: int = 1,
    temperature: float = 1.0,
    top_p: float = 1.0,
    max_new_tokens: int,
    seed: int | Sequence[int] | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    stop: Sequence[Sequence[int]] | None = None,
    prefill_chunk_size: int = 1,
    kv_sharing: str | None = None,
    share_prompt: bool = False,
    callback: Callable[[int], None] | None = None,
) -> GenerationResult:
    """Sample `n` continuations of every prompt (lists of token ids). See module docstring.

    kv_sharing ("first" | "last", LoopLM only) runs the untrained KV-sharing baselines;
    share_prompt=False is their "w/ prefill" form (the prompt keeps Ouro's per-loop cache).
    `callback(k)` is called after each decoding step with the number of new tokens.
    """
    if not isinstance(model, LoopLMForCausalLM):
        raise TypeError("the native engine runs LoopLM and MELT models; use transformers' generate for others")
    if kv_sharing not in KV_SHARING:
        raise ValueError(f"kv_sharing must be one of {KV_SHARING}, got {kv_sharing!r}")
    if kv_sharing and isinstance(model, MeltForCausalLM):
        raise ValueError("kv_sharing applies to LoopLM (Ouro) models; MELT always shares its KV cache")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if max_new_tokens < 1 or n < 1 or prefill_chunk_size < 1:
        raise ValueError("max_new_tokens, n and prefill_chunk_size must be >= 1")

    device, dtype = model.lm_head.weight.device, model.lm_head.weight.dtype
    num_prompts, rows = len(prompts), len(prompts) * n
    p_max = max(len(p) for p in prompts)
    seeds = [seed] * num_prompts if seed is None or isinstance(seed, int) else list(seed)
    if len(seeds) != num_prompts:
        raise ValueError("seed must be an int or one int per prompt")
    generators = []
    for i in range(num_prompts):
        for j in range(n):
            g = torch.Generator(device=device)
            if seeds[i] is None:
                g.seed()
            else:
                g.manual_seed(row_seed(seeds[i], j))
            generators.append(g)
    eos = set([eos_token_id] if isinstance(eos_token_id, int) else (eos_token_id or []))
    stops = [list(s) for s in (stop or []) if len(s)]

    caches = _Caches(model, rows, p_max, max_new_tokens, kv_sharing, share_prompt, dtype, device)
    shared_prompt = kv_sharing is None or share_prompt
    chunk = prefill_chunk_size if (isinstance(model, MeltForCausalLM) or (kv_sharing and share_prompt)) else None

    # Prefill: each prompt alone, into the rows of its first sample, then copied to the others.
    last_logits = torch.empty(rows, model.config.vocab_size, dtype=torch.float32, device=device)
    for i, prompt in enumerate(prompts):
        r0, p_len = i * n, len(prompt)
        policy = caches.prefill_policy(model, slice(r0, r0 + 1), p_max - p_len, kv_sharing if shared_prompt else None)
        ids = torch.tensor([list(prompt)], device=device)
        step = chunk or p_len
        for s in range(0, p_len, step):
            e = min(s + step, p_len)
            pos = torch.arange(s, e, device=device)[None]
            x, _ = model.model.run_chunk(ids[:, s:e], pos, policy, kv_sharing=kv_sharing if shared_prompt else None)
        if n > 1:
            caches.replicate(r0, slice(r0 + 1, r0 + n))
        last_logits[r0 : r0 + n] = model.lm_head(x[:, -1]).float()
    if caches.hybrid:
        caches.prompt_store.length = p_max

    # Decode: all rows together, one token per step.
    policy = caches.decode_policy(model, kv_sharing)
    if not caches.hybrid:
        caches.store.length = p_max
    prompt_lens = torch.tensor([len(p) for p in prompts for _ in range(n)], device=device)
    capacity = p_max + max_new_tokens
    key_mask = torch.arange(capacity, device=device)[None, :] >= (p_max - prompt_lens)[:, None]  # [rows, S]

    sequences: list[list[int]] = [[] for _ in range(rows)]
    logprobs: list[list[float]] = [[] for _ in range(rows)]
    finish = ["length"] * rows
    active = [True] * rows
    logits = last_logits
    for step in range(max_new_tokens):
        tokens = sample_next(logits, temperature, top_p, generators)
        token_logprobs = torch.log_softmax(logits.float(), dim=-1).gather(-1, tokens[:, None])[:, 0]
        # one device-to-host copy per step; the bookkeeping below is plain Python
        tokens_host, logprobs_host = tokens.tolist(), token_logprobs.tolist()
        newly = 0
        for r in range(rows):
            if not active[r]:
                continue
            tok = tokens_host[r]
            sequences[r].append(tok)
            logprobs[r].append(logprobs_host[r])
            newly += 1
            if tok in eos or any(sequences[r][-len(s) :] == s for s in stops):
                active[r] = False
                finish[r] = "stop"
        if callback is not None:
            callback(newly)
        if not any(active) or step == max_new_tokens - 1:
            break
        pos = (prompt_lens + step)[:, None]
        x, _ = model.model.run_chunk(tokens[:, None], pos, policy, key_mask=key_mask, kv_sharing=kv_sharing)
        logits = model.lm_head(x[:, -1]).float()

    def per_prompt(flat):
        return [flat[i * n : (i + 1) * n] for i in range(num_prompts)]

    return GenerationResult(
        sequences=per_prompt(sequences),
        logprobs=per_prompt(logprobs),
        peak_cache_bytes=caches.nbytes,
        num_generated_tokens=sum(len(s) for s in sequences),
        finish_reasons=per_prompt(finish),
    )
