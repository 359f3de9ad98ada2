"""`melt-eval run`, `melt-eval score`, `melt-eval tasks`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal, Optional

import typer
from rich.console import Console
from rich.table import Table

from melt_eval.cache_layout import KV_CACHE_DTYPES, KV_SHARING
from melt_eval.units import byte_size

# The fixed sets options choose from, spelled as the library spells them (tests/test_cli_flags.py checks them
# against melt_eval.generation.backends.BACKENDS, which this module does not import: it loads torch).
# Options typed with these Literals take one of their values (click's error names them, exit 2).
Backend = Literal["native", "vllm", "endpoint"]
KvSharing = Literal[tuple(v for v in KV_SHARING if v is not None)]  # first | last
KvCacheDtype = Literal[KV_CACHE_DTYPES]  # auto | fp8 | int8 | int4
Dtype = Literal["auto", "bfloat16", "float16", "float32"]
TableOrJson = Literal["table", "json"]
# Width of a console writing into a pipe or file: wide enough that no cell is cut ("tiny-…").
PIPE_WIDTH = 10_000


def console() -> Console:
    """The terminal's console; into a pipe or a file one so wide that tables are never squeezed."""
    terminal = Console()
    return terminal if terminal.is_terminal else Console(width=PIPE_WIDTH)


def _print_results(results: list[dict]) -> None:
    table = Table(title="melt-eval results")
    for col in ("model", "task", "metric", "value (%)", "stderr", "problems", "samples", "tokens", "wall s"):
        table.add_column(col, justify="right" if col not in ("model", "task", "metric") else "left")
    for r in results:
        for name, m in r["metrics"].items():
            stderr = "" if m.get("stderr") is None else f"{100 * m['stderr']:.2f}"
            table.add_row(r["model"], r["task"], name, f"{100 * m['value']:.2f}", stderr, str(r["num_problems"]),
                          str(r["settings"]["samples"]), str(r["generated_tokens"]), f"{r['wall_time_s']:.1f}")
    console().print(table)


MODEL, GENERATION, EVALUATION, OUTPUT, MEMORY, SECURITY = (
    "Model", "Generation", "Evaluation", "Output", "Memory", "Security (HumanEval sandbox)")


def register(app: typer.Typer) -> None:
    @app.command()
    def run(
        tasks: str = typer.Argument(..., help="Task names or groups, comma-separated (paper, math, ablation)."),
        model: str = typer.Option(..., "--model", rich_help_panel=MODEL,
                                  help="Registry name (melt-eval models), checkpoint directory, or Hugging Face Hub id "
                                       "ORG/NAME or ORG/NAME@REVISION (from the Hub's local cache when offline)."),
        revision: Optional[str] = typer.Option(
            None, "--revision", rich_help_panel=MODEL,
            help="Branch, tag or commit of a Hub --model (default: main; same as ORG/NAME@REVISION)."),
        backend: Backend = typer.Option(
            "native", "--backend", rich_help_panel=MODEL,
            help="native (in-process engine) | vllm | endpoint (an OpenAI-compatible server: --base-url)."),
        base_url: Optional[str] = typer.Option(
            None, "--base-url", rich_help_panel=MODEL,
            help="--backend endpoint: URL[,URL...], replicas of one served model (no default: required there)."),
        api_key: Optional[str] = typer.Option(
            None, "--api-key", rich_help_panel=MODEL, show_default=False,
            help="--backend endpoint: API key sent as 'Authorization: Bearer KEY' (default: the OPENAI_API_KEY "
                 "environment variable; none when that is unset)."),
        max_concurrency: Optional[int] = typer.Option(None, "--max-concurrency", rich_help_panel=MODEL,
                                                      help="--backend endpoint: requests in flight (one per problem; "
                                                           "default 64)."),
        dtype: Optional[Dtype] = typer.Option(None, "--dtype",
                                            rich_help_panel=MODEL, help="--backend vllm: weights' dtype (default auto)."),
        tensor_parallel_size: Optional[int] = typer.Option(
            None, "--tensor-parallel-size", rich_help_panel=MODEL, help="--backend vllm: GPUs per model (default 1)."),
        loops: Optional[int] = typer.Option(None, "--loops", rich_help_panel=MODEL,
                                            help="Override the number of loops T at inference (default: the checkpoint's)."),
        kv_sharing: Optional[KvSharing] = typer.Option(
            None, "--kv-sharing", rich_help_panel=MODEL,
            help="Ouro, untrained baselines: share one KV cache across loops, keeping the first or last loop's "
                 "entries (default: none, a cache per loop)."),
        share_prompt: bool = typer.Option(False, "--share-prompt", rich_help_panel=MODEL,
                                          help="KV sharing also over the prompt (no prefill; default: off)."),
        prefill_chunk: Optional[int] = typer.Option(
            None, "--prefill-chunk", rich_help_panel=MODEL, show_default=False,
            help="Prompt chunk size C (1 = exact MELT). Default: what the checkpoint was trained with, from its "
                 "melt_eval_training.json (the prompt whole where it trained the prompt as one chunk, else its "
                 "chunk_size); 1 without one. `run` prints which."),
        exit: Optional[str] = typer.Option(
            None, "--exit", rich_help_panel=MODEL, metavar="gate:Q|agree:K",
            help="Early exit of generated tokens (native engine; the prompt keeps full depth): gate:Q stops a token "
                 "at the first loop where Ouro's cumulative exit probability reaches Q (0 < Q <= 1), agree:K once its "
                 "top token stays the same K more loops (K >= 1). Default: none, every loop (= gate:1). MELT is trained "
                 "with every earlier entry at loop T; exit-aware training (recipe key exit_aware_p) teaches it to read "
                 "early-exited ones (docs/training.md#exit-aware-fine-tuning)."),
        kv_cache_dtype: KvCacheDtype = typer.Option(
            "auto", "--kv-cache-dtype", rich_help_panel=MODEL,
            help="How the KV cache stores entries: auto (the model's dtype) | fp8 | int8 | int4 (KIVI: keys per "
                 "channel, values per token, groups of 32, the last 32 tokens in full precision; native engine; "
                 "--backend vllm takes fp8). See docs/evaluation.md#quantized-kv-caches."),
        cross_loop_kv: bool = typer.Option(
            False, "--cross-loop-kv", rich_help_panel=MODEL,
            help="Ouro, training-free: keep loop 1's KV in full precision and loops 2..T as int4 deltas from it "
                 "(FlashLoop's idea; native engine; default: off)."),
        cuda_graphs: bool = typer.Option(
            True, "--cuda-graphs/--no-cuda-graphs", rich_help_panel=MODEL,
            help="Native engine on CUDA: compile the decode token step and replay it as a CUDA graph (default: on; "
                 "--no-cuda-graphs runs it eagerly, as on the CPU). Early exit and quantized caches decode eagerly. "
                 "See docs/evaluation.md#cuda-graphs."),
        samples: Optional[int] = typer.Option(None, "--samples", rich_help_panel=GENERATION,
                                              help="Samples per problem (default: the paper's, per task)."),
        temperature: float = typer.Option(1.0, "--temperature", rich_help_panel=GENERATION,
                                          help="Sampling temperature (0 = greedy)."),
        top_p: float = typer.Option(0.7, "--top-p", rich_help_panel=GENERATION, help="Nucleus sampling: top-p."),
        max_new_tokens: Optional[int] = typer.Option(None, "--max-new-tokens", rich_help_panel=GENERATION,
                                                     help="Tokens generated per sample (default: the paper's, per task)."),
        seed: int = typer.Option(0, "--seed", min=0, max=2**62 - 1, rich_help_panel=GENERATION,
                                 help="Sampling seed (each problem's seed derives from it)."),
        max_model_len: Optional[int] = typer.Option(
            None, "--max-model-len", rich_help_panel=GENERATION,
            help="--backend vllm: prompt + generation limit (default: the model's)."),
        allow_beyond_max_positions: bool = typer.Option(
            False, "--allow-beyond-max-positions", rich_help_panel=GENERATION,
            help="Let prompt + max new tokens exceed the model's max_position_embeddings (extrapolation; default: refused)."),
        verify: bool = typer.Option(
            True, "--verify/--no-verify",
            help="Check a checkpoint directory's files against its SHA256SUMS before loading (default: on; "
                 "--no-verify skips reading every byte once, for very large models)."),
        max_problems: Optional[int] = typer.Option(
            None, "--max-problems", "--limit", "--max-samples", rich_help_panel=EVALUATION,
            help="First N problems of each task (default: all). --limit and --max-samples are the same option."),
        data_dir: Optional[Path] = typer.Option(
            None, "--data-dir", rich_help_panel=EVALUATION,
            help="Read DIR/<task>.jsonl|.parquet instead of the Hub (default: the Hub, or built in)."),
        log_samples: bool = typer.Option(
            False, "--log-samples", rich_help_panel=OUTPUT,
            help="Also write lm-evaluation-harness's samples_<task>_<date>.jsonl beside the results (default: off)."),
        force: bool = typer.Option(False, "--force", rich_help_panel=EVALUATION,
                                   help="Recompute finished tasks and discard partial ones (default: off, resume)."),
        output: Path = typer.Option(Path("results"), "--output", "--output-dir", rich_help_panel=OUTPUT,
                                    help="Results root: OUTPUT/<name>/<task>/. --output-dir is the same option."),
        name: Optional[str] = typer.Option(
            None, "--name", rich_help_panel=OUTPUT,
            help="Name for the results (default: the registry name or the checkpoint's directory name)."),
        progress: bool = typer.Option(True, "--progress/--no-progress", rich_help_panel=OUTPUT,
                                      help="Show progress bars (on stderr)."),
        max_cache_bytes: Optional[int] = typer.Option(
            None, "--max-cache-bytes", parser=byte_size("--max-cache-bytes"), metavar="SIZE", rich_help_panel=MEMORY,
            help="KV-cache budget (bytes, or 512MiB, 40GB...). Native engine: samples that do not fit together run "
                 "in waves, with the same results (default 80% of free GPU memory, 50% of free host memory); "
                 "vLLM: the KV cache it allocates."),
        kv_cache_bytes: Optional[int] = typer.Option(
            None, "--kv-cache-bytes", parser=byte_size("--kv-cache-bytes"), metavar="SIZE", rich_help_panel=MEMORY,
            help="--backend vllm: fixed KV cache budget (bytes, or 512MiB, 40GB...; default --max-cache-bytes, "
                 "else vLLM's own from --gpu-memory-utilization)."),
        gpu_memory_utilization: Optional[float] = typer.Option(
            None, "--gpu-memory-utilization", rich_help_panel=MEMORY,
            help="--backend vllm: GPU memory share (default: vLLM's, 0.9)."),
        unsafe_local_exec: bool = typer.Option(
            False, "--unsafe-local-exec", rich_help_panel=SECURITY,
            help="HumanEval: run model-written code even where the kernel refuses a sandbox layer (default: off, refuse to run)."),
    ) -> None:
        """Evaluate a model with LightEval and the paper's protocol; resumable."""
        from melt_eval.errors import UserError
        from melt_eval.evaluation.paths import check_name
        from melt_eval.generation.options import InferenceOptions, Sampling, model_facts

        for flag, value in (("--api-key", api_key), ("--max-concurrency", max_concurrency)):
            if value is not None and backend != "endpoint":
                raise UserError(f"{flag} goes with --backend endpoint; drop it here")

        # before torch, LightEval or any weight loads (they take seconds to minutes): the flags, --name, and the
        # options against the model's config.json or registry facts, each refused in one line at once
        options = InferenceOptions(
            loops=loops, kv_sharing=kv_sharing, share_prompt=share_prompt, prefill_chunk=prefill_chunk, exit=exit,
            kv_cache_dtype=kv_cache_dtype, cross_loop_kv=cross_loop_kv, cuda_graphs=cuda_graphs,
            sampling=Sampling(samples=samples, temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens,
                              seed=seed),
        )
        check_name(name)
        if backend != "endpoint":  # an endpoint's model options are the server's (refused below)
            options.check_model(model_facts(model), native=backend == "native")
        from melt_eval.evaluation import BackendSettings, RunPaths, run_tasks

        paths = RunPaths(output=output, name=name, data_dir=data_dir)
        settings = BackendSettings(
            kind=backend, max_cache_bytes=max_cache_bytes, api_key=api_key,
            allow_beyond_max_positions=allow_beyond_max_positions, base_url=base_url,
            verify=verify, **({} if max_concurrency is None else {"max_concurrency": max_concurrency}),
            engine=dict(dtype=dtype, max_model_len=max_model_len, gpu_memory_utilization=gpu_memory_utilization,
                        kv_cache_bytes=kv_cache_bytes, tensor_parallel_size=tensor_parallel_size),
        )
        try:
            results = run_tasks(tasks, model, options, paths, backend=settings, revision=revision, max_problems=max_problems,
                                force=force, progress=progress, unsafe_local_exec=unsafe_local_exec, log_samples=log_samples,
                                note=lambda line: typer.echo(line, err=True))
        except KeyboardInterrupt:
            from melt_eval import interrupts

            typer.secho("interrupted: finished problems are saved; run the same command again to continue",
                        fg=typer.colors.YELLOW, err=True)
            interrupts.handled()
            raise typer.Exit(130) from None
        _print_results(results)

    @app.command()
    def score(
        task: str = typer.Argument(..., help="One task name."),
        completions: Path = typer.Option(..., "--completions", help='JSONL: {"index"|"id": ..., "completions": [...]}'),
        data_dir: Optional[Path] = typer.Option(
            None, "--data-dir", help="Read DIR/<task>.jsonl|.parquet instead of the Hub (default: the Hub, or built in)."),
        fmt: TableOrJson = typer.Option("table", "--format",
                                        help="table | json (one object: metrics, their stderr, num_problems)."),
        details: Optional[Path] = typer.Option(
            None, "--details", help="Also write per-problem details here (JSONL; default: not written)."),
        unsafe_local_exec: bool = typer.Option(
            False, "--unsafe-local-exec",
            help="HumanEval: run model-written code even where the kernel refuses a sandbox layer (default: off, refuse to run)."),
    ) -> None:
        """Score saved or external completions with the task's metric."""
        from melt_eval.errors import UserError
        from melt_eval.evaluation import score_completions

        from melt_eval.files import check_output_path, write_failed, write_text_atomic

        if details:  # a directory, a device (/dev/full) or a path inside a file: refused before scoring
            check_output_path(details, "--details", directory=False)
        result = score_completions(task, completions, data_dir=data_dir, unsafe_local_exec=unsafe_local_exec)
        if details:
            try:
                details.parent.mkdir(parents=True, exist_ok=True)
                write_text_atomic(details, "".join(json.dumps(d) + "\n" for d in result["details"]))
            except OSError as exc:
                raise write_failed(exc, details, "nothing was written there") from None
        if fmt == "json":
            out = {name: m["value"] for name, m in result["metrics"].items()}
            out.update({f"{name}_stderr": m["stderr"] for name, m in result["metrics"].items()})
            out["num_problems"] = result["num_problems"]
            from melt_eval.jsonio import dumps  # strict: a NaN stderr prints as null

            typer.echo(dumps(out))
            return
        table = Table(title=f"{result['task']}: {result['num_problems']} problems scored")
        table.add_column("metric")
        table.add_column("value (%)", justify="right")
        table.add_column("stderr", justify="right")
        for name, m in result["metrics"].items():
            table.add_row(name, f"{100 * m['value']:.2f}", "" if m["stderr"] is None else f"{100 * m['stderr']:.2f}")
        console().print(table)

    @app.command("tasks")
    def tasks_cmd(fmt: TableOrJson = typer.Option("table", "--format", help="table | json (tasks and groups).")) -> None:
        """The benchmarks: problems, metrics, samples per problem, source."""
        from melt_eval.protocol.tasks import BENCHMARKS, GROUPS

        rows = [
            {"task": s.name, "problems": s.num_problems, "metrics": s.metric_names, "samples": s.samples,
             "max_new_tokens": s.max_new_tokens, "source": s.hf_repo or "built in", "note": s.note}
            for s in BENCHMARKS.values()
        ]
        if fmt == "json":
            typer.echo(json.dumps({"tasks": rows, "groups": GROUPS}, indent=2))
            return
        table = Table(title="melt-eval tasks")
        for col in ("task", "problems", "metrics", "samples", "max new tokens", "source"):
            table.add_column(col)
        for r in rows:
            table.add_row(r["task"], str(r["problems"] or "-"), ", ".join(r["metrics"]), str(r["samples"]),
                          str(r["max_new_tokens"]), r["source"])
        out = console()
        out.print(table)
        out.print("groups: " + "; ".join(f"{g} = {', '.join(ts)}" for g, ts in GROUPS.items()))
