"""Native generation for LoopLM and MELT: batched incremental decoding with explicit caches.

Each prompt is prefilled on its own (chunked by `options.prefill_chunk` where the KV is
shared across loops, so the chunk rule is exactly MELT's), straight into its rows of
one batched, preallocated cache; then all prompts x samples decode together, one token
per step. The cache layout is right-aligned: prompt i fills columns
[P_max - P_i, P_max), generated tokens follow at P_max, P_max + 1, ...

What the cache holds per token (T x N entries for Ouro, N for MELT, ...) is the model's
`melt_eval.cache_layout.CacheLayout` with the run's options; the engine allocates its stores
and asks `kv_cache.policy_for` for the rule that reads them. `peak_cache_bytes` is the size
of the cache tensors actually allocated, measured with `Tensor.nbytes`.

Memory is predictable: before anything is allocated, `plan_waves` computes one row's cache
(`cache_bytes_per_row`, exact: the same shapes `_Caches` allocates) and splits the prompts x
samples rows into waves that each fit `max_cache_bytes` (default: a share of the device's
free memory, `default_cache_budget`). Waves run one after another with the same padding;
every row has its own generator seeded by (prompt seed, sample), so the sequences are the
same whatever the budget. A request that cannot fit even one row, or that asks for positions
beyond the model's `max_position_embeddings`, or for non-finite sampling values, is refused
with a `GenerationRequestError` (a UserError: one line at the CLI) naming the wrong number.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from melt_eval.errors import UserError
from melt_eval.generation.decode_step import DecodeStep, captured_mode
from melt_eval.generation.options import InferenceOptions, Sampling
from melt_eval.cache_layout import CacheLayout, compressed_layout, layout_of
from melt_eval.modeling import early_exit
from melt_eval.modeling.kv_cache import StaticStore, policy_for
from melt_eval.modeling.kv_quant import QuantizedStore
from melt_eval.modeling.looplm import LoopLMForCausalLM
from melt_eval.units import format_bytes

Tensor = torch.Tensor

# Share of the free memory the cache may take by default: on a GPU the weights are already
# loaded and decoding's other tensors are small; on a CPU the host's other processes need room.
CACHE_SHARE = {"cuda": 0.8, "cpu": 0.5}


class GenerationRequestError(UserError, ValueError):
    """A generation request that cannot run as asked (refused before any allocation)."""


@dataclass
class GenerationResult:
    sequences: list[list[list[int]]]  # [prompt][sample] -> generated token ids (EOS included)
    logprobs: list[list[list[float]]]  # same shape: log p(token) under the last loop, before sampling transforms
    peak_cache_bytes: int = 0
    num_generated_tokens: int = 0
    analytic_cache_bytes: int = 0  # the same wave's bytes by cache_layout's formula (equal to the measured ones)
    rows_per_wave: int = 0
    finish_reasons: list[list[str]] = field(default_factory=list)  # "stop" | "length"
    # with options.exit: [prompt][sample] -> tokens that ran 1, 2, ..., T loops (decode steps; the prompt's
    # full-depth prefill not counted); None without early exit
    loop_counts: list[list[list[int]]] | None = None


def row_seed(prompt_seed: int, sample: int) -> int:
    """Seed of one (prompt, sample): independent of batching and of how many samples are drawn."""
    return (prompt_seed * 1_000_003 + sample * 7_919 + 12_345) % (2**63 - 1)


def sample_next(logits: Tensor, temperature: float, top_p: float, uniforms: Tensor | None) -> Tensor:
    """One token per row from [B, V] logits: greedy at temperature 0, else nucleus sampling by inverse
    transform of each row's uniform draw in [0, 1) (`uniforms`, [B]; `draw_uniforms`). One vectorised
    step for all rows: a multinomial per row's generator costs a kernel launch per row and step."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    order = None
    if top_p < 1.0:
        probs, order = probs.sort(dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the token crossing it included)
        probs = probs.masked_fill(probs.cumsum(-1) - probs >= top_p, 0.0)
    cdf = probs.double().cumsum(-1)
    # the first token whose cumulative mass exceeds u x total mass: a token of mass 0 is never picked
    picked = torch.searchsorted(cdf, (uniforms.to(cdf) * cdf[:, -1])[:, None], right=True).clamp_(max=probs.shape[-1] - 1)
    return (picked if order is None else order.gather(-1, picked))[:, 0]


def draw_uniforms(generators: Sequence[torch.Generator], steps: int) -> Tensor:
    """[rows, steps] uniform draws, row r's from its own generator: a row's tokens do not depend on
    which rows share its batch or wave."""
    return torch.stack([torch.rand(steps, generator=g, device=g.device, dtype=torch.float64) for g in generators])


def free_device_bytes(device) -> int:
    """Memory free for new tensors: the GPU's (with what PyTorch's allocator holds unused), or the host's."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024


def default_cache_budget(device) -> int:
    """The cache budget when none is given: a safe share (CACHE_SHARE) of the device's free memory."""
    kind = torch.device(device).type
    return int(free_device_bytes(device) * CACHE_SHARE.get(kind, 0.5))


def run_layout(model, kv_sharing=None, share_prompt=False, kv_cache_dtype="auto", cross_loop_kv=False) -> CacheLayout:
    """The cache of a generation run: the model's layout with the run's options (a LayoutError if they do not fit)."""
    layout = layout_of(model.config, kv_sharing=kv_sharing, share_prompt=share_prompt)
    return compressed_layout(layout, kv_cache_dtype, cross_loop_kv)


def cache_bytes_per_row(model, prompt_tokens: int, max_new_tokens: int, *, kv_sharing=None, share_prompt=False,
                        dtype=None, kv_cache_dtype="auto", cross_loop_kv=False) -> int:
    """Bytes of cache one (prompt, sample) row takes: the shapes `_Caches` allocates, without allocating."""
    dtype = dtype or model.lm_head.weight.dtype
    return run_layout(model, kv_sharing, share_prompt, kv_cache_dtype, cross_loop_kv).nbytes(
        prompt_tokens, max_new_tokens, bytes_per_value=torch.empty((), dtype=dtype).element_size())


def plan_waves(model, *, prompt_tokens: int, max_new_tokens: int, rows: int, kv_sharing=None, share_prompt=False,
               max_cache_bytes: int | None = None, allow_beyond_max_positions: bool = False, dtype=None,
               device=None, kv_cache_dtype="auto", cross_loop_kv=False) -> int:
    """Rows per wave for `rows` rows of `prompt_tokens` + `max_new_tokens` within the cache budget.

    Refuses (GenerationRequestError) what cannot run: positions beyond the model's
    max_position_embeddings (unless allowed) and a single row larger than the budget."""
    cfg = model.config
    limit = getattr(cfg, "max_position_embeddings", None)
    if limit and prompt_tokens >= limit and not allow_beyond_max_positions:
        raise GenerationRequestError(
            f"a {prompt_tokens}-token prompt leaves no room below the model's max_position_embeddings {limit}; "
            "shorten the problem (or pass --allow-beyond-max-positions to extrapolate)"
        )
    if limit and prompt_tokens + max_new_tokens > limit and not allow_beyond_max_positions:
        raise GenerationRequestError(
            f"a {prompt_tokens}-token prompt + max_new_tokens {max_new_tokens} = {prompt_tokens + max_new_tokens} "
            f"positions, beyond the model's max_position_embeddings {limit}; lower --max-new-tokens "
            "(or pass --allow-beyond-max-positions to extrapolate)"
        )
    if not isinstance(model, LoopLMForCausalLM):
        return rows
    T = cfg.total_ut_steps
    if isinstance(T, bool) or not isinstance(T, int) or T < 1:
        raise GenerationRequestError(f"the number of loops must be a whole number >= 1, got {T!r}")
    if max_cache_bytes is None:
        max_cache_bytes = default_cache_budget(device if device is not None else model.lm_head.weight.device)
    per_row = cache_bytes_per_row(model, prompt_tokens, max_new_tokens, kv_sharing=kv_sharing,
                                  share_prompt=share_prompt, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                                  cross_loop_kv=cross_loop_kv)
    if per_row > max_cache_bytes:
        layout = run_layout(model, kv_sharing, share_prompt, kv_cache_dtype, cross_loop_kv).describe()
        raise GenerationRequestError(
            f"one sample's KV cache needs {format_bytes(per_row)} ({layout}, {prompt_tokens} prompt + "
            f"{max_new_tokens} new tokens), more than the cache budget of {format_bytes(max_cache_bytes)}; "
            "lower --loops or --max-new-tokens, or raise --max-cache-bytes"
        )
    return max(1, min(rows, max_cache_bytes // per_row))


class _Caches:
    """The batched cache for one generate() call and the policy that reads it."""

    def __init__(self, layout: CacheLayout, rows: int, p_max: int, max_new: int, dtype, device):
        dims = dict(batch=rows, kv_heads=layout.kv_heads, head_dim=layout.head_dim, dtype=dtype, device=device)
        prompt_keys, generated_keys = layout.store_keys()
        self.layout = layout
        self.hybrid = prompt_keys != generated_keys  # the "w/ prefill" baselines: a store for each
        self.store_type = StaticStore
        if layout.compressed:  # one quantized store (cache_layout refuses the hybrid layout quantized)
            self.store_type = QuantizedStore
            self.store = QuantizedStore(layout, prompt_keys, capacity=p_max + max_new, **dims)
            self.stores = [self.store]
        elif self.hybrid:
            self.prompt_store = StaticStore(prompt_keys, capacity=p_max, **dims)
            self.gen_store = StaticStore(generated_keys, capacity=max_new, **dims)
            self.stores = [self.prompt_store, self.gen_store]
        else:
            self.store = StaticStore(prompt_keys, capacity=p_max + max_new, **dims)
            self.stores = [self.store]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.stores)

    def prefill_policy(self, rows: slice, start: int):
        """Policy writing one prompt into its rows, from column `start`."""
        return policy_for(self.layout, self.store_type.view_of(self.prompt_store if self.hybrid else self.store, rows, start))

    def decode_policy(self):
        if self.hybrid:
            return policy_for(self.layout, self.prompt_store, generated_store=self.gen_store)
        return policy_for(self.layout, self.store)

    def replicate(self, src: int, dst: slice) -> None:
        for s in self.stores:
            s.copy_rows(src, dst)


# cuDNN's attention builds a new execution plan per call when the key length keeps changing, host
# time paid for each of the LoopLM's T x N cache buffers at every step (measured:
# docs/results/2026-11-26-benchmarks.md#decode-native-engine); the other fused kernels do not,
# so decoding leaves it out.
_DECODE_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def generate(
    model: LoopLMForCausalLM,
    prompts: Sequence[Sequence[int]],
    options: InferenceOptions = InferenceOptions(),
    *,
    n: int = 1,
    temperature: float = 1.0,
    top_p: float = 1.0,
    max_new_tokens: int,
    seed: int | Sequence[int] | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    stop: Sequence[Sequence[int]] | None = None,
    callback: Callable[[int], None] | None = None,
    max_cache_bytes: int | None = None,
    allow_beyond_max_positions: bool = False,
    decode_mode: str | None = None,
) -> GenerationResult:
    """Sample `n` continuations of every prompt (lists of token ids). See module docstring.

    `options` is how the model runs (validated when built): its loops (None: the config's), the
    untrained KV-sharing baselines (kv_sharing "first" | "last", LoopLM only; share_prompt=False is
    their "w/ prefill" form, the prompt keeping Ouro's per-loop cache) and the prompt chunk. The
    sampling of this call is its own arguments, as vLLM splits an engine from its SamplingParams
    (`options.sampling` is the harness's run-level setting, read by the LightEval model).
    `callback(k)` is called after each decoding step with the number of new tokens.
    `max_cache_bytes` bounds the cache (default: `default_cache_budget`); rows that do not fit
    together run in waves, with the same results.
    `decode_mode` ("eager" | "compiled" | "graphed"; None: graphed on CUDA unless `options.cuda_graphs` is off,
    eager elsewhere) is how the decode token step runs (generation/decode_step.py).
    """
    if not isinstance(model, LoopLMForCausalLM):
        raise TypeError("the native engine runs LoopLM and MELT models; use transformers' generate for others")
    # refuses an option the model's cache does not take
    run_layout(model, options.kv_sharing, options.share_prompt, options.kv_cache_dtype, options.cross_loop_kv)
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    # the run options' check, its errors naming this call's arguments
    Sampling.check(dict(samples=n, temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens),
                   spelling="arguments", error=GenerationRequestError)
    loops = model.config.total_ut_steps
    options.apply_loops(model.config)  # for this call only
    try:
        return _generate(model, prompts, options, n=n, temperature=temperature, top_p=top_p,
                         max_new_tokens=max_new_tokens, seed=seed, eos_token_id=eos_token_id, stop=stop,
                         callback=callback, max_cache_bytes=max_cache_bytes,
                         allow_beyond_max_positions=allow_beyond_max_positions, decode_mode=decode_mode)
    finally:
        model.config.total_ut_steps = loops


@torch.no_grad()
@sdpa_kernel(_DECODE_ATTENTION)
def _generate(model, prompts, options: InferenceOptions, *, n, temperature, top_p, max_new_tokens, seed, eos_token_id,
              stop, callback, max_cache_bytes, allow_beyond_max_positions, decode_mode) -> GenerationResult:
    kv_sharing, share_prompt = options.kv_sharing, options.share_prompt
    compression = dict(kv_cache_dtype=options.kv_cache_dtype, cross_loop_kv=options.cross_loop_kv)

    device, dtype = model.lm_head.weight.device, model.lm_head.weight.dtype
    num_prompts = len(prompts)
    p_max = max(len(p) for p in prompts)
    seeds = [seed] * num_prompts if seed is None or isinstance(seed, int) else list(seed)
    if len(seeds) != num_prompts:
        raise ValueError("seed must be an int or one int per prompt")
    total_rows = num_prompts * n  # row r is sample r % n of prompt r // n, in output order
    per_wave = plan_waves(model, prompt_tokens=p_max, max_new_tokens=max_new_tokens, rows=total_rows,
                          kv_sharing=kv_sharing, share_prompt=share_prompt, max_cache_bytes=max_cache_bytes,
                          allow_beyond_max_positions=allow_beyond_max_positions, dtype=dtype, device=device,
                          **compression)
    eos = set([eos_token_id] if isinstance(eos_token_id, int) else (eos_token_id or []))
    stops = [list(s) for s in (stop or []) if len(s)]

    sequences: list[list[int]] = []
    logprobs: list[list[float]] = []
    finish: list[str] = []
    counts: list[list[int]] = []
    peak = analytic = 0
    for start in range(0, total_rows, per_wave):
        wave = [divmod(r, n) for r in range(start, min(start + per_wave, total_rows))]
        generators = []
        for i, j in wave:
            g = torch.Generator(device=device)
            if seeds[i] is None:
                g.seed()
            else:
                g.manual_seed(row_seed(seeds[i], j))
            generators.append(g)
        # the wave's prompts, each with the number of its samples in the wave (consecutive rows)
        groups: list[list] = []
        for i, _ in wave:
            if groups and groups[-1][0] == i:
                groups[-1][1] += 1
            else:
                groups.append([i, 1])
        caches = _Caches(run_layout(model, kv_sharing, share_prompt, **compression), len(wave), p_max, max_new_tokens, dtype, device)
        peak = max(peak, caches.nbytes)
        analytic = max(analytic, caches.layout.nbytes(p_max, max_new_tokens, torch.empty((), dtype=dtype).element_size())
                       * len(wave))
        seqs, lps, fins, wave_counts = _decode_wave(
            model, caches, [(prompts[i], k) for i, k in groups], generators, p_max=p_max,
            max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, eos=eos, stops=stops,
            prefill_chunk=options.chunk, kv_sharing=kv_sharing, callback=callback,
            exit_rule=options.exit_rule, decode_mode=decode_mode, cuda_graphs=options.cuda_graphs,
        )
        del caches
        sequences += seqs
        logprobs += lps
        finish += fins
        counts += wave_counts

    def per_prompt(flat):
        return [flat[i * n : (i + 1) * n] for i in range(num_prompts)]

    return GenerationResult(
        sequences=per_prompt(sequences),
        logprobs=per_prompt(logprobs),
        peak_cache_bytes=peak,
        analytic_cache_bytes=analytic,
        rows_per_wave=per_wave,
        num_generated_tokens=sum(len(s) for s in sequences),
        finish_reasons=per_prompt(finish),
        loop_counts=per_prompt(counts) if options.exit_rule else None,
    )


_NOTED: set[str] = set()


def _note_once(note: str) -> None:
    """A fallback from the captured decode step, said once per process (a run calls generate many times)."""
    if note not in _NOTED:
        _NOTED.add(note)
        warnings.warn(note, stacklevel=3)


def _decode_wave(model, caches: _Caches, groups, generators, *, p_max, max_new_tokens, temperature, top_p, eos, stops,
                 prefill_chunk, kv_sharing, callback, exit_rule=None, decode_mode=None, cuda_graphs=True):
    """Prefill and decode one wave: `groups` is [(prompt, rows of that prompt)], rows consecutive."""
    device = model.lm_head.weight.device
    chunk = prefill_chunk if caches.layout.prefill_chunk_matters else None  # else the prompt is one chunk
    rows = sum(k for _, k in groups)

    # Prefill: each prompt alone, into the first of its rows, then copied to the others.
    last_logits = torch.empty(rows, model.config.vocab_size, dtype=torch.float32, device=device)
    r0 = 0
    for prompt, k in groups:
        p_len = len(prompt)
        policy = caches.prefill_policy(slice(r0, r0 + 1), p_max - p_len)
        ids = torch.tensor([list(prompt)], device=device)
        step = chunk or p_len
        for s in range(0, p_len, step):
            e = min(s + step, p_len)
            pos = torch.arange(s, e, device=device)[None]
            x, _ = model.model.run_chunk(ids[:, s:e], pos, policy, kv_sharing=kv_sharing)
        if k > 1:
            caches.replicate(r0, slice(r0 + 1, r0 + k))
        last_logits[r0 : r0 + k] = model.lm_head(x[:, -1]).float()
        r0 += k
    if caches.hybrid:
        caches.prompt_store.length = p_max

    # Decode: all rows together, one token per step.
    policy = caches.decode_policy()
    if not caches.hybrid:
        caches.store.length = p_max
    prompt_lens = torch.tensor([len(p) for p, k in groups for _ in range(k)], device=device)
    capacity = p_max + max_new_tokens
    key_mask = torch.arange(capacity, device=device)[None, :] >= (p_max - prompt_lens)[:, None]  # [rows, S]
    mode, note = captured_mode(device, policy, cuda_graphs=cuda_graphs, exit_rule=exit_rule, requested=decode_mode)
    if note:
        _note_once(note)
    step_logits = DecodeStep(model, policy, key_mask, kv_sharing=kv_sharing, mode=mode)

    sequences: list[list[int]] = [[] for _ in range(rows)]
    logprobs: list[list[float]] = [[] for _ in range(rows)]
    finish = ["length"] * rows
    active = [True] * rows
    loops = model.config.total_ut_steps
    counts = [[0] * loops for _ in range(rows)]  # per row: generated tokens that ran 1..T loops (exit_rule)
    logits = last_logits
    uniforms = draw_uniforms(generators, max_new_tokens) if temperature > 0 else None
    for step in range(max_new_tokens):
        tokens = sample_next(logits, temperature, top_p, None if uniforms is None else uniforms[:, step])
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
        if exit_rule is None:
            logits = step_logits(tokens[:, None], pos)
            continue
        # each row stops looping by the rule; the prompt above kept full depth
        logits, used = early_exit.decode_step(model, tokens[:, None], pos, policy, exit_rule, key_mask=key_mask,
                                              kv_sharing=kv_sharing)
        for r, depth in enumerate(used.tolist()):
            if active[r]:
                counts[r][depth - 1] += 1
    return sequences, logprobs, finish, counts
