"""`melt-eval run`, `melt-eval score`, `melt-eval tasks`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table


def _print_results(results: list[dict]) -> None:
    table = Table(title="melt-eval results")
    for col in ("model", "task", "metric", "value (%)", "stderr", "problems", "samples", "tokens", "wall s"):
        table.add_column(col, justify="right" if col not in ("model", "task", "metric") else "left")
    for r in results:
        for name, m in r["metrics"].items():
            stderr = "" if m.get("stderr") is None else f"{100 * m['stderr']:.2f}"
            table.add_row(r["model"], r["task"], name, f"{100 * m['value']:.2f}", stderr, str(r["num_problems"]),
                          str(r["settings"]["samples"]), str(r["generated_tokens"]), f"{r['wall_time_s']:.1f}")
    Console().print(table)


def register(app: typer.Typer) -> None:
    @app.command()
    def run(
        tasks: str = typer.Argument(..., help="Task names or groups, comma-separated (paper, math, ablation)."),
        model: str = typer.Option(..., "--model", help="Registry name (melt-eval models) or checkpoint directory."),
        backend: str = typer.Option("native", help="native | vllm | endpoint (an OpenAI-compatible server: --base-url)"),
        samples: Optional[int] = typer.Option(None, help="Samples per problem (default: the paper's, per task)."),
        temperature: float = typer.Option(1.0, help="Sampling temperature (0 = greedy)."),
        top_p: float = typer.Option(0.7, "--top-p"),
        max_new_tokens: Optional[int] = typer.Option(None, "--max-new-tokens", help="Default: the paper's, per task."),
        max_problems: Optional[int] = typer.Option(None, "--max-problems", help="First N problems of each task."),
        loops: Optional[int] = typer.Option(None, help="Override the number of loops T at inference."),
        kv_sharing: Optional[str] = typer.Option(None, "--kv-sharing", help="first | last (Ouro, untrained baselines)."),
        share_prompt: bool = typer.Option(False, "--share-prompt", help="KV sharing also over the prompt (no prefill)."),
        prefill_chunk: int = typer.Option(1, "--prefill-chunk", help="Prompt chunk size C (1 = exact MELT)."),
        data_dir: Optional[Path] = typer.Option(None, "--data-dir", help="DIR/<task>.jsonl|.parquet instead of the Hub."),
        output: Path = typer.Option(Path("results"), help="Results root: OUTPUT/<name>/<task>/."),
        name: Optional[str] = typer.Option(None, help="Name for the results (default: the registry name or the checkpoint's directory name)."),
        seed: int = typer.Option(0),
        force: bool = typer.Option(False, help="Recompute finished tasks and discard partial ones."),
        progress: bool = typer.Option(True, "--progress/--no-progress"),
        unsafe_local_exec: bool = typer.Option(
            False, "--unsafe-local-exec",
            help="HumanEval: run model-written code even where the kernel refuses a sandbox layer."),
        max_cache_bytes: Optional[str] = typer.Option(
            None, "--max-cache-bytes",
            help="KV-cache budget (bytes, or 512MiB, 40GB...). Native engine: samples that do not fit together run "
                 "in waves, with the same results (default 80% of free GPU memory, 50% of free host memory); "
                 "vLLM: the KV cache it allocates."),
        allow_beyond_max_positions: bool = typer.Option(
            False, "--allow-beyond-max-positions",
            help="Let prompt + max new tokens exceed the model's max_position_embeddings (extrapolation)."),
        base_url: Optional[str] = typer.Option(None, "--base-url", help="Endpoint(s), URL[,URL...]: replicas of one served model."),
        max_concurrency: int = typer.Option(64, "--max-concurrency", help="Endpoint requests in flight (one per problem)."),
        dtype: Optional[str] = typer.Option(None, help="vLLM: auto | bfloat16 | float16 | float32."),
        max_model_len: Optional[int] = typer.Option(None, "--max-model-len", help="vLLM: prompt + generation limit."),
        gpu_memory_utilization: Optional[float] = typer.Option(None, "--gpu-memory-utilization", help="vLLM: GPU memory share."),
        kv_cache_bytes: Optional[int] = typer.Option(None, "--kv-cache-bytes", help="vLLM: fixed KV cache budget, bytes."),
        tensor_parallel_size: Optional[int] = typer.Option(None, "--tensor-parallel-size", help="vLLM: GPUs per model."),
    ) -> None:
        """Evaluate a model with LightEval and the paper's protocol; resumable."""
        from melt_eval.evaluation import BackendSettings, RunPaths, run_tasks
        from melt_eval.generation.options import InferenceOptions, Sampling
        from melt_eval.units import parse_bytes

        options = InferenceOptions(
            loops=loops, kv_sharing=kv_sharing, share_prompt=share_prompt, prefill_chunk=prefill_chunk,
            sampling=Sampling(samples=samples, temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens,
                              seed=seed),
        )
        paths = RunPaths(output=output, name=name, data_dir=data_dir)
        settings = BackendSettings(
            kind=backend, max_cache_bytes=None if max_cache_bytes is None else parse_bytes(max_cache_bytes),
            allow_beyond_max_positions=allow_beyond_max_positions, base_url=base_url, max_concurrency=max_concurrency,
            engine=dict(dtype=dtype, max_model_len=max_model_len, gpu_memory_utilization=gpu_memory_utilization,
                        kv_cache_bytes=kv_cache_bytes, tensor_parallel_size=tensor_parallel_size),
        )
        try:
            results = run_tasks(tasks, model, options, paths, backend=settings, max_problems=max_problems, force=force,
                                progress=progress, unsafe_local_exec=unsafe_local_exec)
        except KeyboardInterrupt:
            typer.secho("interrupted: finished problems are saved; run the same command again to continue",
                        fg=typer.colors.YELLOW, err=True)
            raise typer.Exit(130) from None
        _print_results(results)

    @app.command()
    def score(
        task: str = typer.Argument(..., help="One task name."),
        completions: Path = typer.Option(..., "--completions", help='JSONL: {"index"|"id": ..., "completions": [...]}'),
        data_dir: Optional[Path] = typer.Option(None, "--data-dir"),
        fmt: str = typer.Option("table", "--format", help="table | json"),
        details: Optional[Path] = typer.Option(None, "--details", help="Also write per-problem details here (JSONL)."),
        unsafe_local_exec: bool = typer.Option(
            False, "--unsafe-local-exec",
            help="HumanEval: run model-written code even where the kernel refuses a sandbox layer."),
    ) -> None:
        """Score saved or external completions with the task's metric."""
        from melt_eval.errors import UserError
        from melt_eval.evaluation import score_completions

        if fmt not in ("table", "json"):
            raise UserError("--format must be table or json")
        if details and (details.is_dir() or (details.parent.exists() and not details.parent.is_dir())):
            raise UserError(f"--details {details} is a directory or inside a file; pass a file path to write")
        result = score_completions(task, completions, data_dir=data_dir, unsafe_local_exec=unsafe_local_exec)
        if details:
            details.parent.mkdir(parents=True, exist_ok=True)
            details.write_text("".join(json.dumps(d) + "\n" for d in result["details"]))
        if fmt == "json":
            out = {name: m["value"] for name, m in result["metrics"].items()}
            out.update({f"{name}_stderr": m["stderr"] for name, m in result["metrics"].items()})
            out["num_problems"] = result["num_problems"]
            typer.echo(json.dumps(out))
            return
        table = Table(title=f"{result['task']}: {result['num_problems']} problems scored")
        table.add_column("metric")
        table.add_column("value (%)", justify="right")
        table.add_column("stderr", justify="right")
        for name, m in result["metrics"].items():
            table.add_row(name, f"{100 * m['value']:.2f}", "" if m["stderr"] is None else f"{100 * m['stderr']:.2f}")
        Console().print(table)

    @app.command("tasks")
    def tasks_cmd(fmt: str = typer.Option("table", "--format", help="table | json")) -> None:
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
        Console().print(table)
        Console().print("groups: " + "; ".join(f"{g} = {', '.join(ts)}" for g, ts in GROUPS.items()))
