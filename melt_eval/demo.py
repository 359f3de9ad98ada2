"""`melt-eval demo`: the whole reproduction in miniature, on a 2-core CPU.

1. `ouro-tiny`: a LoopLM (T = 4) trained from scratch on the synthetic task (recipe pretrain-tiny);
2. MELT from it with the two-phase recipe (tiny-phase1, tiny-phase2), the gate ablation, the
   component-removal ladder and the untrained KV-sharing variants (`melt_eval.ablations`, preset tiny);
3. every model evaluated on the synthetic task's test split with the paper's protocol (16 samples,
   temperature 1.0, top-p 0.7, pass@1 and pass@10) through LightEval, plus T = 1..4 at inference
   for the loops figure;
4. the report: every table, the LaTeX and markdown, the figures; the paper's own tables beside.

Everything is cached under OUTPUT: a second run skips finished training and evaluation and only
re-renders; an interrupted one resumes.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import typer

from melt_eval import ablations
from melt_eval.ablations import TrainRun

TASK = "synthetic"


@dataclass(frozen=True)
class DemoSize:
    pretrain: dict  # overrides of recipe pretrain-tiny
    melt: dict | None  # overrides of every tiny-phase1/2 run (None: the recipes as they are)
    problems: int  # test problems evaluated (of 200)
    loops: tuple[int, ...]  # T at inference for the loops figure


FULL = DemoSize(pretrain={}, melt=None, problems=50, loops=(1, 2, 3, 4))
QUICK = DemoSize(pretrain={"max_steps": 100, "batch_tokens": 2048, "micro_batch_size": 32, "save_every": 50},
                 melt={"max_steps": 4, "save_every": 4}, problems=8, loops=(2, 4))
EVAL = dict(samples=16, temperature=1.0, top_p=0.7, seed=0)


def eval_settings(size: DemoSize) -> dict:
    """`run_tasks` options for every model of the demo. Prompts are prefilled in chunks of the MELT
    recipes' training chunk (MELT.md: prefill follows the training rule) and decoding is exact; Ouro is
    unaffected, its per-loop cache makes chunks irrelevant."""
    from melt_eval.training.config import load_recipe

    return dict(EVAL, max_problems=size.problems, prefill_chunk=load_recipe("tiny-phase1").chunk_size)


def teacher_run(size: DemoSize) -> TrainRun:
    """The teacher `ouro-tiny`: recipe pretrain-tiny from scratch on the tiny-random-ouro architecture."""
    return TrainRun(0, "pretrain-tiny", dict(size.pretrain), "tiny-random-ouro")


def run_demo(output: Path, quick: bool = False, progress: bool = True) -> dict:
    size = QUICK if quick else FULL
    started = time.perf_counter()
    runs, results = output / "runs", output / "results"
    evaluated: dict = {}
    ev = eval_settings(size)

    stages: dict[str, float] = {}  # wall seconds per stage (a cached stage takes seconds)
    current = ["", started]

    def say(stage: str, msg: str = "") -> None:
        now = time.perf_counter()
        if current[0]:
            stages[current[0]] = round(now - current[1], 1)
        current[:] = [stage, now]
        if progress and msg:
            typer.secho(msg, bold=True)

    say("teacher", "[1/4] the teacher: ouro-tiny, a LoopLM trained from scratch on the synthetic task")
    teacher_made_by = teacher_run(size)
    teacher = str(ablations.train_run(teacher_made_by, runs, progress))

    say("melt+ablations", "[2/4] MELT and the ablations: gates, component ladder, untrained KV sharing")
    variants = [v for a in ablations.ABLATIONS for v in ablations.plan(a, "tiny", teacher_made_by, size.melt)]
    ablations.run_variants(variants, runs_dir=runs, output=results, tasks=TASK, eval_kwargs=ev, progress=progress,
                           evaluated=evaluated)
    full = next(v for v in variants if v.ablation == "components" and v.name == "full")
    melt = str(runs / full.train[-1].run_id)

    say("main+loops", "[3/4] the main comparison and the loops figure")
    main = {"ouro-tiny": teacher, "melt-tiny": melt}
    for name, model in main.items():
        ablations.evaluate_once(model, results / name, name, TASK, evaluated=evaluated, progress=progress, **ev)
        for loops in size.loops:
            if loops != 4:  # T = 4 is the main result
                from melt_eval.evaluation import run_tasks

                run_tasks(TASK, model, results_dir=results / "loops" / f"{name}-T{loops}", name=name, loops=loops,
                          progress=progress, **ev)

    say("report", "[4/4] the report")
    from melt_eval.report.cli import print_tables, write_report
    from melt_eval.report.results import load_results
    from melt_eval.report.tables import build_tables, render_markdown_report

    report = write_report(results, output / "report", plot_task=TASK)
    paper_tables = [t for t in build_tables(load_results(output / "no-results")) if t.key != "main"]
    (output / "report" / "paper_tables.md").write_text(render_markdown_report(paper_tables))
    teacher_result = json.loads((results / "ouro-tiny" / TASK / "results.json").read_text())
    say("")
    summary = {
        "quick": quick, "wall_time_s": round(time.perf_counter() - started, 1), "stages_s": stages,
        "teacher_pass@1": teacher_result["metrics"]["pass@1"]["value"],
        "files": [str(f) for f in report["files"]] + [str(output / "report" / "paper_tables.md")],
    }
    (output / "demo.json").write_text(json.dumps(summary, indent=2) + "\n")
    if progress:
        tables = [t for t in report["tables"] if t.key != "main"]  # the paper's benchmarks are not run here
        print_tables(tables)
        typer.secho("The paper's ablation tables, for comparison:", bold=True)
        print_tables(paper_tables)
        for f in summary["files"]:
            typer.echo(f"wrote {f}")
        typer.echo(f"demo finished in {summary['wall_time_s']:.0f} s ({', '.join(f'{k} {v:.0f} s' for k, v in stages.items())})")
        typer.echo(f"teacher (ouro-tiny) pass@1 on the synthetic test split: {100 * summary['teacher_pass@1']:.1f}%"
                   + ("" if quick or summary["teacher_pass@1"] >= 0.5 else " (below the 50% the full demo aims for)"))
    return summary


def register(app: typer.Typer) -> None:
    @app.command()
    def demo(
        quick: bool = typer.Option(False, "--quick", help="Smaller everything, for CI (its numbers mean nothing)."),
        output: Optional[Path] = typer.Option(None, help="Where runs, results and the report go (default demo/ or demo-quick/)."),
        progress: bool = typer.Option(True, "--progress/--no-progress"),
    ) -> None:
        """A miniature reproduction on the CPU: teacher, MELT, every ablation, every table and figure."""
        run_demo(output or Path("demo-quick" if quick else "demo"), quick=quick, progress=progress)
