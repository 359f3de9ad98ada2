"""Generation backends: what turns prompts (token ids) into `n` sampled texts each, for a run.

* `NativeBackend`: LoopLM and MELT through the native engine (`melt_eval.generation.engine`), any
  other transformers causal LM through its own `generate`;
* `VllmBackend`: `melt_eval.generation.vllm_backend.VllmGenerator`;
* `EndpointBackend`: OpenAI-compatible completions servers (`melt_eval.generation.endpoint`), each
  problem handed back as soon as its request returns;
* `ReplayBackend`: completions read from a file (`melt-eval score`), nothing generated.

`make_backend` builds the one a run asks for (`BackendSettings`) with its tokenizer, the run's number
of loops and the config's fingerprint. Callers (the evaluation's LightEval model) pass prompts, seeds
and sampling in; nothing here knows about tasks, problems or LightEval.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from melt_eval.errors import UserError
from melt_eval.generation.options import InferenceOptions, Sampling

BACKENDS = ("native", "vllm", "endpoint")
# vLLM engine settings `--backend vllm` takes (and `melt-eval serve` passes to the server)
ENGINE_OPTIONS = ("dtype", "max_model_len", "gpu_memory_utilization", "kv_cache_bytes", "tensor_parallel_size")


@dataclass(frozen=True)
class BackendSettings:
    """Which backend generates and its own settings (they change memory and speed, not the samples,
    except vLLM's dtype): `max_cache_bytes`, `allow_beyond_max_positions` (native; the first is also
    vLLM's KV budget), `engine` (vLLM, keys of ENGINE_OPTIONS), `base_url`/`max_concurrency`/`api_key` (endpoint;
    no key: OPENAI_API_KEY's)."""

    kind: str = "native"
    max_cache_bytes: int | None = None
    allow_beyond_max_positions: bool = False
    engine: dict = field(default_factory=dict)
    base_url: str | list[str] | None = None
    max_concurrency: int = 64
    api_key: str | None = field(default=None, repr=False)
    verify: bool = True  # check a checkpoint directory against its SHA256SUMS (`run --no-verify` skips it)

    def __post_init__(self) -> None:
        if self.kind not in BACKENDS:
            raise UserError(f"unknown backend {self.kind!r}; choose one of {', '.join(BACKENDS)}")
        if unknown := set(self.engine or {}) - set(ENGINE_OPTIONS):
            raise UserError(f"unknown engine settings {sorted(unknown)}; known: {', '.join(ENGINE_OPTIONS)}")


@dataclass
class Batch:
    texts: list[list[str]]  # [prompt][sample]
    tokens: list[int]  # generated tokens per prompt, all samples
    peak_cache_bytes: int | None = None
    loop_counts: list[list[int]] | None = None  # --exit: per prompt, its tokens that ran 1, 2, ..., T loops


class NativeBackend:
    """The native engine for LoopLM/MELT; transformers' generate for any other causal LM."""

    def __init__(self, model, tokenizer, options: InferenceOptions, *, batch_rows=64, max_cache_bytes=None,
                 allow_beyond_max_positions=False) -> None:
        from melt_eval.modeling import LoopLMForCausalLM

        self.model, self.tokenizer, self.options = model, tokenizer, options
        self.looped = isinstance(model, LoopLMForCausalLM)  # make_backend refused loop options for any other model
        self.batch_rows = batch_rows
        self.max_cache_bytes, self.allow_beyond_max_positions = max_cache_bytes, allow_beyond_max_positions
        self.peak_cache_bytes = 0
        self.cache_info: dict = {}

    def describe(self) -> dict:
        """The measured peak's analytic twin and its rows (per sequence = peak / rows), with the cache's storage."""
        if not self.looped:
            return {}
        return {**self.cache_info, "kv_cache_dtype": self.options.kv_cache_dtype,
                "cross_loop_kv": self.options.cross_loop_kv}

    def problems_per_batch(self, samples: int) -> int:
        return max(1, self.batch_rows // samples)

    def start(self) -> None:
        pass

    def close(self) -> None:
        pass

    def generate(self, prompts: list[list[int]], seeds: list[int], s: Sampling, eos: list[int]) -> Batch:
        if self.looped:
            from melt_eval.generation.engine import generate

            res = generate(
                self.model, prompts, self.options, n=s.samples, temperature=s.temperature, top_p=s.top_p,
                max_new_tokens=s.max_new_tokens, seed=seeds, eos_token_id=eos,
                max_cache_bytes=self.max_cache_bytes, allow_beyond_max_positions=self.allow_beyond_max_positions,
            )
            if res.peak_cache_bytes >= self.peak_cache_bytes:  # the analytic figure of the measured peak's wave
                self.cache_info = {"analytic_cache_bytes": res.analytic_cache_bytes,
                                   "cache_rows": min(res.rows_per_wave, len(prompts) * s.samples)}
            self.peak_cache_bytes = max(self.peak_cache_bytes, res.peak_cache_bytes)
            texts = [[self._decode(seq) for seq in per] for per in res.sequences]
            tokens = [sum(len(seq) for seq in per) for per in res.sequences]
            counts = None if res.loop_counts is None else [[sum(c) for c in zip(*per)] for per in res.loop_counts]
            return Batch(texts, tokens, res.peak_cache_bytes, counts)
        from melt_eval.generation.engine import plan_waves

        texts, tokens = [], []
        for prompt, seed in zip(prompts, seeds):  # HF generate: one prompt (n samples) at a time
            plan_waves(self.model, prompt_tokens=len(prompt), max_new_tokens=s.max_new_tokens, rows=s.samples,
                       allow_beyond_max_positions=self.allow_beyond_max_positions)  # refuses positions it cannot hold
            torch.manual_seed(seed)
            ids = torch.tensor([prompt], device=self.model.device)
            kwargs = dict(do_sample=s.temperature > 0, max_new_tokens=s.max_new_tokens, num_return_sequences=s.samples,
                          eos_token_id=eos, pad_token_id=self.tokenizer.pad_token_id or eos[0])
            if s.temperature > 0:
                kwargs.update(temperature=s.temperature, top_p=s.top_p, top_k=0)
            with torch.no_grad():
                out = self.model.generate(ids, attention_mask=torch.ones_like(ids), return_dict_in_generate=True,
                                          **kwargs)
            self.peak_cache_bytes = max(self.peak_cache_bytes, _cache_bytes(out.past_key_values))
            seqs = [self._trim(row[len(prompt):].tolist(), eos) for row in out.sequences]
            texts.append([self._decode(q) for q in seqs])
            tokens.append(sum(len(q) for q in seqs))
        return Batch(texts, tokens)

    @staticmethod
    def _trim(seq: list[int], eos: list[int]) -> list[int]:
        for i, t in enumerate(seq):
            if t in eos:
                return seq[: i + 1]
        return seq

    def _decode(self, seq: list[int]) -> str:
        return self.tokenizer.decode(seq, skip_special_tokens=True)


def _cache_bytes(cache) -> int:
    """Bytes held by a transformers KV cache at the end of generation (its largest size)."""
    tensors = []
    for layer in getattr(cache, "layers", None) or []:
        tensors += [t for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if torch.is_tensor(t)]
    return sum(t.numel() * t.element_size() for t in tensors)


class VllmBackend:
    """vLLM through the harness's generator (the vLLM plugin serves LoopLM and MELT)."""

    def __init__(self, generator_cls, model_path: str, tokenizer, options: InferenceOptions, **engine) -> None:
        self.tokenizer = tokenizer
        self.engine = engine  # dtype, max_model_len, gpu_memory_utilization, kv_cache_bytes, tensor_parallel_size
        self._make = lambda: generator_cls(model_path, options, **engine)
        self.generator = None
        self.peak_cache_bytes = 0

    def identity_settings(self) -> dict:
        return {"dtype": self.engine.get("dtype") or "auto"}  # the rest changes memory and speed, not the samples

    def describe(self) -> dict:
        return {"engine": self.generator.engine_info()} if self.generator is not None else {}

    def start(self) -> None:
        if self.generator is None:
            self.generator = self._make()

    def close(self) -> None:
        if self.generator is not None:
            self.generator.close()
            self.generator = None

    def problems_per_batch(self, samples: int) -> int:
        return 10_000  # vLLM schedules on its own

    def generate(self, prompts, seeds, s: Sampling, eos) -> Batch:
        self.start()
        res = self.generator.generate(prompts, n=s.samples, temperature=s.temperature, top_p=s.top_p,
                                      max_new_tokens=s.max_new_tokens, seed=seeds, stop_token_ids=eos)
        self.peak_cache_bytes = max(self.peak_cache_bytes, res.peak_cache_bytes or 0)
        texts = [[self.tokenizer.decode(q, skip_special_tokens=True) for q in per] for per in res.sequences]
        return Batch(texts, [sum(len(q) for q in per) for per in res.sequences], res.peak_cache_bytes)


class EndpointBackend:
    """Any OpenAI-compatible completions server(s): one request per problem, bounded concurrency."""

    peak_cache_bytes = None  # the server's memory is not ours to read

    def __init__(self, base_urls, tokenizer, *, max_concurrency: int = 64, api_key: str | None = None) -> None:
        from melt_eval.generation.endpoint import Endpoint

        self.tokenizer = tokenizer
        self.endpoint = Endpoint(base_urls, max_concurrency=max_concurrency, api_key=api_key)
        self.server: dict | None = None

    def start(self) -> None:
        if self.server is None:
            self.server = self.endpoint.info()

    def identity_settings(self) -> dict:
        self.start()
        return {"served_model": self.server["served_model"]}

    def describe(self) -> dict:
        return {"endpoint": {**self.server, "max_concurrency": self.endpoint.max_concurrency,
                             "retried_requests": self.endpoint.retried}}

    def close(self) -> None:
        self.endpoint.close()

    def problems_per_batch(self, samples: int) -> int:
        return 10_000  # requests stream: each finished problem is stored at once

    def generate_each(self, prompts, seeds, s: Sampling, eos):
        """(position, texts, tokens) per problem, in the order they finish."""
        self.start()
        requests = [dict(prompt_ids=p, n=s.samples, temperature=s.temperature, top_p=s.top_p,
                         max_tokens=s.max_new_tokens, seed=seed, stop_token_ids=eos) for p, seed in zip(prompts, seeds)]
        for pos, c in self.endpoint.complete_many(requests):
            texts = c.texts if c.token_ids is None else [self.tokenizer.decode(q, skip_special_tokens=True) for q in c.token_ids]
            yield pos, texts, c.num_tokens

    def generate(self, prompts, seeds, s: Sampling, eos) -> Batch:
        texts, tokens = [None] * len(prompts), [0] * len(prompts)
        for pos, t, n in self.generate_each(prompts, seeds, s, eos):
            texts[pos], tokens[pos] = t, n
        return Batch(texts, tokens)


class ReplayBackend:
    """Completions from a file, looked up by the problem's key; used by `melt-eval score`."""

    peak_cache_bytes = None

    def problems_per_batch(self, samples: int) -> int:
        return 10_000

    def start(self) -> None:
        pass

    def close(self) -> None:
        pass

    def generate(self, prompts, seeds, s, eos) -> Batch:  # pragma: no cover - never called
        raise AssertionError("replay runs read every problem from the store")


# ------------------------------------------------------------------------------- make_backend


@dataclass
class LoadedBackend:
    """What `make_backend` returns: the backend and what a run records about the model it generates with."""

    model_dir: Path
    backend: NativeBackend | VllmBackend | EndpointBackend
    tokenizer: object
    loops: int | None  # the run's T (results.json's "loops"); None for a model that does not loop
    config_hash: str
    model: object | None = None  # the in-process model (native backend only)
    options: InferenceOptions | None = None  # the run's options, prefill_chunk decided (InferenceOptions.for_checkpoint)
    note: str | None = None  # where a default prefill chunk came from, for the user


def config_hash(config) -> str:
    """The architecture's fingerprint; `_name_or_path` is left out, it is how the directory was spelled."""
    fields = {k: v for k, v in config.to_dict().items() if k != "_name_or_path"}
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _vllm_generator():
    try:
        from melt_eval.generation.vllm_backend import VllmGenerator
    except ImportError as exc:
        raise UserError(f"--backend vllm is unavailable here ({exc}); install vLLM (pip install 'melt-eval[vllm]') "
                        "or use --backend native") from None
    return VllmGenerator


def check_backend_settings(options: InferenceOptions, settings: BackendSettings) -> None:
    """The option combinations `settings.kind` refuses whatever the model: checked before any data or
    model is loaded (run_tasks) and again by make_backend."""
    kind = settings.kind
    engine = {k: v for k, v in (settings.engine or {}).items() if v is not None}
    if engine and kind != "vllm":
        flags = ", ".join("--" + k.replace("_", "-") for k in engine)
        where = "the server's (melt-eval serve takes them)" if kind == "endpoint" else "--backend vllm options"
        raise UserError(f"{flags}: {where}; drop them here")
    if (settings.base_url is not None) != (kind == "endpoint"):
        raise UserError("--base-url goes with --backend endpoint (and --backend endpoint needs --base-url)")
    if kind != "native" and options.exit is not None:
        raise UserError(f"--exit runs on the native engine only (--backend {kind} runs every loop); "
                        "use --backend native or drop --exit")
    if kind == "endpoint" and options.sets_model_options:
        raise UserError("--loops, --kv-sharing, --share-prompt, --prefill-chunk, --kv-cache-dtype and --cross-loop-kv "
                        "are the server's settings with --backend endpoint: pass them to `melt-eval serve` (or leave "
                        "them out) and drop them here")
    if kind == "vllm" and options.kv_cache_dtype in ("int8", "int4"):
        raise UserError(f"--kv-cache-dtype {options.kv_cache_dtype} runs on --backend native only (vLLM takes auto or fp8)")
    if kind == "vllm" and options.cross_loop_kv:
        raise UserError("--cross-loop-kv runs on --backend native only")
    # vLLM's untrained KV sharing covers the prompt (--share-prompt); cache_layout refuses the other form there


def make_backend(model: str, options: InferenceOptions, settings: BackendSettings) -> LoadedBackend:
    """The backend `settings.kind` for `model` (registry name, checkpoint directory or Hub id
    ORG/NAME[@REVISION]), refusing first the options that backend or model cannot take. Native loads the
    model; vLLM and an endpoint load only the tokenizer and the config. `--loops` is applied here, once
    (`InferenceOptions.apply_loops`)."""
    from melt_eval.modeling import load_model
    from melt_eval.modeling.loading import checkpoint_model_type, load_tokenizer, resolve_model_dir

    kind = settings.kind
    generator_cls = _vllm_generator() if kind == "vllm" else None  # fail before any download or load
    check_backend_settings(options, settings)
    model_dir = resolve_model_dir(model, verify=settings.verify)
    looped = checkpoint_model_type(model_dir) in ("ouro", "melt")
    if options.loops is not None and not looped:
        raise UserError("--loops applies to looped models (Ouro, MELT) only")
    if not looped and options.exit is not None:
        raise UserError("--exit applies to looped models (Ouro, MELT) only")
    if not looped and (options.kv_sharing or options.share_prompt):
        raise UserError("--kv-sharing and --share-prompt apply to LoopLM (Ouro) models only")
    # the prompt chunk a looped checkpoint was trained with, unless --prefill-chunk says (1 for other models)
    options, note = options.for_checkpoint(model_dir) if looped else (replace(options, prefill_chunk=options.chunk), None)
    if kind == "endpoint":
        note = None  # the server's setting: recorded as `melt-eval serve` defaults it, not the user's to pass here
    engine = {k: v for k, v in (settings.engine or {}).items() if v is not None}

    if kind == "native":
        device = "cuda" if torch.cuda.is_available() else "cpu"
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        loaded, tokenizer = load_model(str(model_dir), dtype=dtype, device=device, verify=False)  # verified above
        loaded.requires_grad_(False)  # evaluated, never trained here: the captured decode step freezes its weights in
        config = loaded.config
    else:
        from transformers import AutoConfig

        # the server (endpoint) or vLLM (which loads the weights itself: a second copy here would take the
        # memory its KV cache needs) generates; locally only the tokenizer (prompts, decoding) and the config
        loaded, tokenizer = None, load_tokenizer(model_dir)
        config = AutoConfig.from_pretrained(str(model_dir))
    # the run's T, written into the config it is fingerprinted from (and the native model runs with)
    loops = options.apply_loops(config) if looped else None
    fingerprint = config_hash(config)

    if kind == "endpoint":
        backend = EndpointBackend(settings.base_url, tokenizer, max_concurrency=settings.max_concurrency,
                                  api_key=settings.api_key)
    elif kind == "vllm":
        if settings.max_cache_bytes is not None:
            # --max-cache-bytes is vLLM's KV budget unless --kv-cache-bytes says otherwise
            engine.setdefault("kv_cache_bytes", settings.max_cache_bytes)
        # vLLM's engine takes --loops from the options (hf_overrides), as `vllm serve` does
        backend = VllmBackend(generator_cls, str(model_dir), tokenizer, options, **engine)
    else:
        # the model's config already holds the run's T: the engine is not handed --loops to set again
        backend = NativeBackend(loaded, tokenizer, replace(options, loops=None),
                                max_cache_bytes=settings.max_cache_bytes,
                                allow_beyond_max_positions=settings.allow_beyond_max_positions)
    return LoadedBackend(model_dir=model_dir, backend=backend, tokenizer=tokenizer, loops=loops,
                         config_hash=fingerprint, model=loaded, options=options, note=note)
