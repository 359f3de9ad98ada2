"""`melt-eval ablate` and `melt-eval demo`."""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Optional

import typer
from rich.console import Console

# Options typed with these take one of their values (click's error names them, exit 2); tests/test_cli_flags.py
# checks them against melt_eval.experiments.ablations (not imported here: it loads the training code).
Preset = Literal["paper", "tiny"]
Backend = Literal["native", "vllm"]
# Width of a console writing into a pipe or a file: wide enough that no cell is cut.
PIPE_WIDTH = 10_000


def console(width: int | None = None) -> Console:
    """The terminal's console (or one `width` wide); into a pipe or a file one so wide nothing is cut."""
    terminal = Console(width=width)
    return terminal if terminal.is_terminal else Console(width=PIPE_WIDTH)


def register(app: typer.Typer) -> None:
    @app.command()
    def ablate(
        ablation: str = typer.Argument(..., help="gates | components | kv-sharing | exit | kv-compression (the last two beyond the paper: exit sweeps --exit gate:Q and agree:K on the preset's Ouro and MELT, or --base; kv-compression runs Ouro and MELT with fp8/int8/int4 caches, Ouro's cross-loop int4 deltas and GQA-MELT (trained with kv_heads: 4, tiny 1); native backend)"),
        preset: Preset = typer.Option("paper", "--preset",
                                      help="paper (Ouro-1.4B, paper recipes) | tiny (CPU-sized recipes)."),
        base: Optional[str] = typer.Option(None, "--base", help="Base LoopLM (default: the preset's)."),
        tasks: Optional[str] = typer.Option(None, "--tasks", help="Tasks to evaluate (default: the preset's: the paper's "
                                            "ablation set, or synthetic for tiny)."),
        backend: Backend = typer.Option("native", "--backend", help="native | vllm: what the evaluations generate with."),
        output: Path = typer.Option(Path("results"), "--output", "--output-dir",
                                    help="Results root (ablations/<ablation>/<variant>/). --output-dir is the same option."),
        runs: Path = typer.Option(Path("runs/ablations"), "--runs", help="Where training runs go."),
        samples: Optional[int] = typer.Option(None, "--samples", min=1, help="Samples per problem (default: the paper's)."),
        max_problems: Optional[int] = typer.Option(
            None, "--max-problems", "--limit", "--max-samples", min=1,
            help="First N problems of each task (default: all). --limit and --max-samples are the same option."),
        max_new_tokens: Optional[int] = typer.Option(None, "--max-new-tokens", min=1,
                                                     help="Tokens generated per sample (default: the paper's, per task)."),
        max_steps: Optional[int] = typer.Option(None, "--max-steps", min=1,
                                                help="Cap every training run's steps (default: the recipes')."),
        data_dir: Optional[Path] = typer.Option(
            None, "--data-dir", help="Read DIR/<task>.jsonl|.parquet instead of the Hub (default: the Hub, or built in)."),
        seed: int = typer.Option(0, "--seed", min=0, max=2**62 - 1, help="Evaluation sampling seed."),
        prefill_chunk: Optional[int] = typer.Option(
            None, "--prefill-chunk", min=1, help="Prompt tokens per MELT chunk in every evaluation (default: 1, exact "
            "MELT, one rule for every row). A MELT trained with the prompt as one chunk, as the demo's are, scores far "
            "lower at 1: pass its seq_len (112 for the demo's) to evaluate it as trained (docs/method.md#prefill)."),
        jobs: int = typer.Option(1, "--jobs", min=1, help="Training runs side by side, each its own process (CPU: one "
                                 "torch thread each, and CPU evaluations likewise, each as soon as its model is trained; "
                                 "GPU: each takes the visible devices, so keep 1)."),
        dry_run: bool = typer.Option(False, "--dry-run",
                                     help="Print every run with its command; run nothing (default: off)."),
        progress: bool = typer.Option(True, "--progress/--no-progress", help="Show progress bars (on stderr)."),
    ) -> None:
        """Run one of the paper's ablations: training (where it has any) and evaluation, each variant's evaluation
        once its model is trained. Resumable."""
        from rich.table import Table

        from melt_eval.experiments import ablations
        from melt_eval.protocol.tasks import expand

        ablations.check_jobs(jobs)
        variants = ablations.plan(ablation, preset, base, {"max_steps": max_steps} if max_steps else None)
        tasks = tasks or ablations.PRESETS[preset]["tasks"]
        expand(tasks)  # unknown tasks fail before anything runs
        if dry_run:
            table = Table(title=f"ablate {ablation} --preset {preset}: plan (nothing run)")
            for col in ("variant", "step", "status", "command", "paper compute"):
                table.add_column(col, overflow="fold")
            for s in ablations.describe(variants, runs, output, tasks, backend):
                table.add_row(s["variant"], s["step"], s["status"], s["command"], s["paper_gpu_hours"])
            console(200).print(table)
            return
        from melt_eval.files import check_output_path

        for path, flag in ((output, "--output"), (runs, "--runs")):  # before the first run trains, not after it
            check_output_path(path, flag, directory=True)
        eval_kwargs = {k: v for k, v in dict(samples=samples, max_problems=max_problems, max_new_tokens=max_new_tokens,
                                             data_dir=data_dir, seed=seed, prefill_chunk=prefill_chunk).items()
                       if v is not None}
        ablations.run_variants(variants, runs_dir=runs, output=output, tasks=tasks, backend=backend,
                               eval_kwargs=eval_kwargs, progress=progress, jobs=jobs)
        from rich.markdown import Markdown

        from melt_eval.report.render import render_markdown
        from melt_eval.report.results import load_results
        from melt_eval.report.tables import ablation_table

        if ablation == "exit":
            from melt_eval.report.tables import exit_table

            console().print(Markdown(render_markdown(exit_table(load_results(output)))))
            return
        console().print(Markdown(render_markdown(ablation_table(load_results(output), ablation))))

    @app.command()
    def demo(
        quick: bool = typer.Option(False, "--quick",
                                   help="Smaller everything, for CI (its numbers mean nothing; default: off)."),
        output: Optional[Path] = typer.Option(None, help="Where runs, results and the report go (default demo/ or "
                                              "demo-quick/, with -seedN for another seed)."),
        seed: int = typer.Option(0, "--seed", min=0, max=2**32 - 1, help="Seeds every training run and the sampling; the claims "
                                 "must hold for more than one."),
        jobs: Optional[int] = typer.Option(None, "--jobs", min=1, help="Training runs and evaluations side by side, "
                                           "one torch thread each (default: the CPU cores, at most 4)."),
        compile: bool = typer.Option(False, "--compile", help="Train MELT with one torch.compile'd function per "
                                     "token (recipe compile: true): faster steps once compiled, but each run compiles "
                                     "first; floats differ from eager in the last bits. Default: off (eager)."),
        beyond_paper: bool = typer.Option(False, "--beyond-paper", help="Also evaluate the trained teacher and MELT "
                                          "beyond the paper, after its rows: early exit (--exit agree:1, agree:2, gate:0.5, "
                                          "gate:0.9, and gate:0.7, 0.9 on a gate fitted to each model by recipe "
                                          "tiny-exit-gate), MELT fine-tuned exit-aware (recipe tiny-exit-aware, its gate fitted; all loops, "
                                          "gate:0.7, gate:0.9), Ouro and MELT with fp8/int8/int4 KV caches, Ouro's cross-loop "
                                          "cache and GQA-MELT (kv_heads 1, both MELT phases trained); the report adds "
                                          "plots/exit.png and these rows on plots/memory_frontier.png. 23 more "
                                          "evaluations, 3 gate fits, exit-aware MELT's and GQA-MELT's training, so off "
                                          "by default (docs/demo.md)."),
        progress: bool = typer.Option(True, "--progress/--no-progress", help="Show progress bars (on stderr)."),
    ) -> None:
        """A miniature reproduction on the CPU: teacher, MELT, every ablation, every table and figure, and
        the paper's claims checked against the numbers."""
        from melt_eval.experiments.demo import default_output, run_demo
        from melt_eval.files import check_output_path

        output = output or default_output(quick, seed)
        check_output_path(output, "--output", directory=True)  # named as --output, before the first stage prints
        run_demo(output, quick=quick, progress=progress, seed=seed, jobs=jobs,
                 compile=compile, beyond_paper=beyond_paper)
