"""`melt-eval train`: run a training recipe (MELT phase 1/2, ablation rows, LoopLM pretraining)."""

from __future__ import annotations

import contextlib
import signal
import threading
from pathlib import Path
from typing import Optional

import typer


def register(app: typer.Typer) -> None:
    @app.command("train")
    def train_cmd(
        ctx: typer.Context,
        recipe: Optional[str] = typer.Option(None, "--recipe", "-r", help="Recipe name in melt_eval/recipes/ (paper-phase1, paper-phase2, tiny-phase1, tiny-phase2, pretrain-tiny; exit-gate, tiny-exit-gate: fit only Ouro's early-exit gate of a LoopLM or MELT checkpoint to its own loop states, for --exit gate:Q, docs/training.md#fitting-the-exit-gate; tiny-exit-aware: continue a phase-2 MELT with reply tokens' shared-cache entries left at random early loops, as --exit leaves them, recipe keys exit_aware_p and exit_aware_loops, docs/training.md#exit-aware-fine-tuning) or a YAML path. Default: paper-phase<--phase>."),
        from_model: Optional[str] = typer.Option(None, "--from", help="Starting model: a LoopLM (phase 1), a phase-1 MELT checkpoint (phase 2), the architecture to pretrain, or the LoopLM or MELT whose exit gate to fit (default: the recipe's)."),
        output: Path = typer.Option(..., "--output", "-o", help="Run directory: final HF model, checkpoints, logs."),
        gate: Optional[str] = typer.Option(None, "--gate", help="MELT gate when converting: elementwise, scalar, ema, mean, last, first (default: the recipe's)."),
        chunk_size: Optional[int] = typer.Option(None, "--chunk-size", help="Chunk size C in tokens; 0 = whole sequence (no chunk-wise training; default: the recipe's)."),
        interpolation_steps: Optional[int] = typer.Option(None, "--interpolation-steps", help="Steps over which alpha rises 0 -> 1; 0 = no interpolated transition (default: the recipe's; 0 in phase 2)."),
        kd: Optional[bool] = typer.Option(None, "--kd/--no-kd", help="All-loop KD against the teacher, or plain SFT (default: the recipe's)."),
        align_beta: Optional[float] = typer.Option(None, "--align-beta", help="Attention-alignment weight; 0 = none (phase 2 default 0.1)."),
        phase: Optional[int] = typer.Option(None, "--phase", help="1: interpolated transition + KD; 2: KD + alignment from a phase-1 checkpoint (default: the recipe's)."),
        teacher: Optional[str] = typer.Option(None, "--teacher", help="Frozen LoopLM teacher (default: the starting LoopLM, or the one phase 1 recorded)."),
        max_steps: Optional[int] = typer.Option(None, "--max-steps", help="Optimiser steps (default: the recipe's)."),
        resume: bool = typer.Option(False, "--resume", help="Continue an interrupted run in --output at its last checkpoint (default: off)."),
        verify: bool = typer.Option(True, "--verify/--no-verify", help="Check the checkpoint directories the run loads (--from, the teacher) against their SHA256SUMS, and --resume's checkpoint against the sums in its trainer_state.json, refusing one without them (default: on; --no-verify loads them unchecked)."),
        config: Optional[Path] = typer.Option(None, "--config", help="YAML file of recipe keys applied over the recipe (default: none)."),
        set_: list[str] = typer.Option([], "--set", help="Override one recipe key: --set key=value (repeatable), e.g. --set kv_heads=4 (grouped-query MELT: key/value heads mean-pooled into 4 groups when converting; docs/training.md)."),
        progress: bool = typer.Option(True, "--progress/--no-progress", help="Show the progress bar."),
        log_with: list[str] = typer.Option([], "--log-with", help="Experiment trackers (Accelerate): tensorboard, wandb, trackio, mlflow, ..., all or none; repeatable or comma-separated (default: the recipe's log_with: tensorboard where installed, in DIR/logs/tb)."),
        push_to_hub: bool = typer.Option(False, "--push-to-hub", help="After a finished run, upload DIR (model, tokenizer, model card) to the Hugging Face Hub (default: off; the model card README.md is written either way)."),
        hub_model_id: Optional[str] = typer.Option(None, "--hub-model-id", help="Hub repo for --push-to-hub, NAME or USER/NAME (default: the --output directory's name)."),
        nproc_per_node: Optional[int] = typer.Option(None, "--nproc-per-node", help="Train on N processes of this machine (one per GPU, or gloo ranks on CPUs): checks the output directory, lock, --resume, recipe and layout, then starts the workers as `torchrun --standalone --nproc-per-node N` would; a refusal is one line (default: this process, or the ranks torchrun or accelerate launch started; docs/training.md#several-processes)."),
    ) -> None:
        """Train MELT from a LoopLM (or a LoopLM from scratch) with a YAML recipe; Accelerate-launchable."""
        # Ctrl-C at any moment (imports, model building, data, a step, a save) is one line and exit 130:
        # every moment leaves a directory the next run continues (checkpoints are atomic)
        with one_line_interrupt(output):
            from melt_eval.errors import UserError
            from melt_eval.training.config import load_recipe, parse_set

            if recipe is None:
                recipe = f"paper-phase{phase or 1}"
            for parent in (output, *output.parents):  # the run directory, or a folder on its way, is a file
                if parent.exists():
                    if not parent.is_dir():
                        raise UserError(f"--output {output}: {parent} is a file, not a directory; pass a directory")
                    break
            overrides = parse_set(set_)
            switches = {"gate": gate, "chunk_size": chunk_size, "interpolation_steps": interpolation_steps, "kd": kd,
                        "align_beta": align_beta, "phase": phase, "teacher": teacher, "max_steps": max_steps,
                        "from_model": from_model, "log_with": ",".join(log_with) or None}
            overrides.update({k: v for k, v in switches.items() if v is not None})
            if phase == 2 and interpolation_steps is None:
                overrides["interpolation_steps"] = 0  # phase 2 runs at alpha = 1
            resolved = load_recipe(recipe, config_file=config, overrides=overrides)
            refuse_unused_flags(resolved, resume=resume, verify=verify, push_to_hub=push_to_hub,
                                hub_model_id=hub_model_id, gate=gate, phase=phase)
            if nproc_per_node is not None:
                launch_workers(ctx, nproc_per_node, resolved, output, resume)
                return
            from melt_eval.training.runner import run_recipe  # torch and Accelerate: after every check above

            out = run_recipe(resolved, output=output, resume=resume, progress=progress, push_to_hub=push_to_hub,
                             hub_model_id=hub_model_id, verify=verify)
            from accelerate import PartialState

            if PartialState().is_main_process:  # once per run, not once per rank
                typer.echo(f"trained model written to {out}")


def launch_workers(ctx: typer.Context, nproc: int, recipe, output: Path, resume: bool) -> None:
    """`train --nproc-per-node N`: check, then start the workers with this command's arguments; a worker that
    died without a refusal is one line saying what to run next, with the launch's exit code."""
    from melt_eval.training.launcher import WorkerFailed, preflight, start_workers, worker_args

    preflight(nproc, recipe, output, resume)
    try:
        start_workers(nproc, worker_args(ctx))
    except WorkerFailed as exc:
        typer.secho(f"error: {exc}; {interrupted_note(output)}", fg=typer.colors.RED, err=True)
        raise typer.Exit(exc.code) from None


def refuse_unused_flags(recipe, *, resume: bool, verify: bool, push_to_hub: bool, hub_model_id: str | None,
                        gate: str | None, phase: int | None) -> None:
    """A flag that would change nothing in this run is refused, never ignored (issue 69: --no-verify was
    accepted and did nothing, so the advice to pass it looped)."""
    from melt_eval.errors import UserError

    if hub_model_id is not None and not push_to_hub:
        raise UserError("--hub-model-id names the repository --push-to-hub uploads to: add --push-to-hub, or drop --hub-model-id")
    local = [flag for flag, ref in (("--from", recipe.from_model), ("--teacher", recipe.teacher))
             if ref and Path(str(ref)).expanduser().is_dir()]
    if not verify and not resume and not local:
        raise UserError("--no-verify skips the SHA-256 check of a checkpoint directory the run loads (--from, --teacher) "
                        "or resumes (--resume); this run loads none (registry names and Hub ids are not checked): "
                        "drop --no-verify")
    if phase is not None and recipe.target != "melt":
        raise UserError(f"--phase picks MELT's training phase; this recipe trains target {recipe.target}: drop --phase")
    if gate is not None:
        if recipe.target != "melt":
            raise UserError(f"--gate sets the gate a LoopLM is converted to MELT with; target {recipe.target} converts "
                            "nothing: drop --gate")
        if _model_type(recipe.from_model) == "melt":
            raise UserError(f"--gate sets the gate a LoopLM is converted to MELT with; {recipe.from_model} is already "
                            "a MELT checkpoint, whose own gate is continued: drop --gate")


def _model_type(ref: str | None) -> str | None:
    """A local directory's config.json model_type, or a registry model's family; None where it is not known
    without loading anything (a Hub id, an unreadable config: the loaders report those)."""
    import json

    from melt_eval.registry import MODELS

    if not ref:
        return None
    path = Path(str(ref)).expanduser()
    if path.is_dir():
        config_file = path / "config.json"
        try:  # a regular file of a config's size only: a FIFO would block the read
            if not config_file.is_file() or config_file.stat().st_size > 16 << 20:
                return None
            config = json.loads(config_file.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return config.get("model_type") if isinstance(config, dict) else None
    spec = MODELS.get(str(ref))
    return spec.family if spec is not None else None


@contextlib.contextmanager
def one_line_interrupt(output: Path):
    """KeyboardInterrupt -> one line saying what to run next, exit 130 (the shell's code for SIGINT). An error
    after Ctrl-C counts as the interrupt: a library lost the KeyboardInterrupt on its way (melt_eval/interrupts.py)."""
    from melt_eval import interrupts
    from melt_eval.training.launch import launch_worker

    try:
        yield
    except BaseException as exc:
        if not interrupts.is_interrupt(exc):
            raise
        main_thread = threading.current_thread() is threading.main_thread()  # signal.signal's condition
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main_thread else None  # a second Ctrl-C
        try:
            if not launch_worker():  # `train --nproc-per-node` says it once, for every rank
                typer.secho(f"interrupted: {interrupted_note(output)}", fg=typer.colors.YELLOW, err=True)
        finally:
            if main_thread:
                signal.signal(signal.SIGINT, previous)
        interrupts.handled()
        raise typer.Exit(130) from None


def interrupted_note(output: Path) -> str:
    """What a Ctrl-C left in `output` and the command that continues from it."""
    from melt_eval.training.checkpoints import resume_candidates
    from melt_eval.training.runs import NOT_STARTED, run_state

    if run_state(output) == NOT_STARTED:
        return "nothing was written yet; run the same command again (without --resume)"
    complete, _ = resume_candidates(output)
    where = f"from {complete[0].name}" if complete else "from step 0 (no checkpoint was complete yet)"
    return f"rerun the same command with --resume to continue {where}"
