"""The one recipe runner: MELT phase 1/2, the ablation rows, and plain LoopLM training.

Built on Hugging Face Accelerate, so the same code runs on a CPU, one GPU, or many GPUs
and nodes under `accelerate launch` (melt_eval/recipes/accelerate/fsdp.yaml). Accelerate owns
device placement, mixed precision, gradient synchronisation and the resumable state;
the MELT-specific parts live beside this file, one concern each (as torchtitan's trainer
components): build.py (the student/teacher pair, the optimiser, the data stream), step.py
(alpha, the objective, gradient accumulation to the recipe's token batch), checkpoints.py,
metrics.py (logs, progress) and run_files.py (the run directory's records, --resume's checks).
This file is only the loop that ties them together.

Output directory layout:

    DIR/config.json, model.safetensors, tokenizer files   final model (HF format)
    DIR/melt_eval_training.json                           recipe, code version, teacher, status
    DIR/README.md                                         model card (a finished run; --push-to-hub uploads DIR)
    DIR/recipe.yaml                                       the fully resolved recipe
    DIR/checkpoints/step-000100/{state/, trainer_state.json}   resumable (Accelerate state + data position)
    DIR/logs/metrics.jsonl, DIR/logs/tb/                   per-step metrics, TensorBoard (Accelerate trackers: log_with)
    DIR/.melt-eval.lock                                    held while a run writes here (melt_eval.files.DirLock)

A checkpoint is written to checkpoints/.tmp-step-N, fsynced, then renamed to step-N, with
trainer_state.json (last) listing every state file and its size; `--resume` takes the newest
step-N whose files are all there at their sizes and that loads, naming any it skipped.

Names other code imports from here stay importable from here: `forward_objective`, `param_groups`,
`lr_factor`, `NonFiniteLoss`, `META_FILE`, `read_metrics`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from melt_eval import compile_cache, float_path, interrupts
from melt_eval.files import DirLock
from melt_eval.training.build import param_groups, prepare_training
from melt_eval.training.checkpoints import load_checkpoint, write_checkpoint
from melt_eval.training.config import Recipe
from melt_eval.training.launch import accelerator_kwargs, announce_layout, check_fsdp, launch_worker, on_main
from melt_eval.training.heldout import HeldoutCheck, held_out_check, held_out_rows
from melt_eval.training.metrics import Logger, progress_bar, read_metrics, status, trackers
from melt_eval.training.runs import FINISHED, run_state
from melt_eval.training.run_files import META_FILE, export, prepare_output, run_meta, write_run_start
from melt_eval.training.step import (GATE_MEANS, NonFiniteLoss, Trainee, forward_objective, lr_factor, read_gate_means,
                                     train_step)

__all__ = ["META_FILE", "NonFiniteLoss", "forward_objective", "lr_factor", "param_groups", "read_metrics",
           "run_recipe", "train"]


def train(recipe: Recipe, output: str | Path, *, resume: bool = False, progress: bool = True, stop_after: int | None = None,
          label: str | None = None, push_to_hub: bool = False, hub_model_id: str | None = None,
          verify: bool = True) -> Path:
    """Run a recipe; returns the output directory (the final model is written there). `verify`: check --from's
    and the teacher's directories against their SHA256SUMS, and --resume's checkpoint against the sums in its
    trainer_state.json, refusing one without them (False: `--no-verify` loads them unchecked).

    The output directory is locked for the run (melt_eval.files.DirLock): a second `train` into it
    is refused with the PID of the first. stop_after: stop (with a resumable checkpoint) once this
    many optimiser steps are done, as if interrupted; used by tests of --resume. A finished run gets a
    model card (DIR/README.md); push_to_hub then uploads DIR to `hub_model_id` (default: DIR's name).
    """
    from accelerate import PartialState

    compile_cache.pin()  # the command line did it already; the Python API too, before anything compiles
    output = Path(output).expanduser().resolve()
    state = PartialState(**accelerator_kwargs())  # joins the launcher's ranks (gloo on CPUs)
    check_fsdp(state)  # before Accelerator(), which fails with a traceback when asked for FSDP without a GPU
    # the lock belongs to the run: rank 0 takes it for all ranks, which wait for the outcome (a refusal stops them all)
    lock = DirLock(output, "training run")
    on_main(state, lock.acquire)
    try:
        _train(recipe, output, resume=resume, progress=progress, stop_after=stop_after, label=label, verify=verify)
    finally:
        lock.release()  # held by rank 0 only (a no-op elsewhere)
    if state.is_main_process and push_to_hub and run_state(output) == FINISHED:
        from melt_eval.training.publish import push_to_hub as push

        print(f"pushed {output} to {push(output, hub_model_id)}")
    return output


@torch.enable_grad()  # whatever the caller's mode (an evaluation earlier in the process may have turned it off)
def _train(recipe: Recipe, output: Path, *, resume: bool, progress: bool, stop_after: int | None,
           label: str | None = None, verify: bool = True) -> Path:
    from accelerate import Accelerator, PartialState
    from accelerate.utils import set_seed

    recipe, candidates, notes = on_main(PartialState(), prepare_output, output, recipe, resume)  # rank 0 checks, once
    rows = held_out_rows(recipe)  # before the model loads: a split too small for the check is one line, in seconds
    mp = recipe.mixed_precision
    if mp == "auto":
        mp = "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "no"
    accelerator = Accelerator(mixed_precision=mp, project_dir=str(output / "logs"), **accelerator_kwargs(),
                              log_with=trackers(recipe.log_with, recipe.tensorboard, output) or None)
    set_seed(recipe.seed)
    lay = announce_layout(accelerator, recipe)
    for note in notes:
        accelerator.print(f"note: {note}")

    trainee, tokenizer, info = prepare_training(accelerator, recipe, mp, verify)
    heldout = held_out_check(recipe, tokenizer, rows)
    start_step, tokens_seen, last_good = 0, 0, None
    if resume:
        start_step, tokens_seen, last_good = load_checkpoint(accelerator, trainee.stream, output, candidates, recipe,
                                                             verify=verify)
    meta = {**run_meta(recipe, info, trainee.world, mp, trainee.accum), "layout": lay}
    if accelerator.is_main_process:
        if launch_worker() and (line := float_path.notice()):  # melt_eval.cli leaves it to here: after the checks
            print(line, file=sys.stderr, flush=True)
        write_run_start(output, recipe, meta)
    logger = Logger(output, accelerator.is_main_process, start_step, accelerator, recipe.to_dict())
    if logger.note:
        accelerator.print(f"note: {logger.note}")

    default_label = {"melt": f"melt phase {recipe.phase}", "exit_gate": "exit gate"}.get(recipe.target, "looplm")
    try:
        step, tokens_seen, stopped = _loop(trainee, output, logger, start_step, tokens_seen, last_good, progress=progress,
                                           stop_after=stop_after, label=label or default_label, heldout=heldout)
    finally:
        logger.close()

    if step < recipe.max_steps and not stopped:  # stopped early on purpose (stop_after): resumable, not finished
        return output
    final = {**meta, "status": "finished", "steps": step, "tokens_seen": tokens_seen}
    if heldout is not None:  # every check, the resumed run's earlier ones from its log (cut back to its checkpoint)
        final["heldout"] = {"checks": logged_checks(output), "stopped_at": step if stopped else None}
    export(accelerator, trainee.model, tokenizer, output, final)
    if accelerator.is_main_process:
        from melt_eval.training.publish import write_model_card

        write_model_card(output, final)
    return output


def _loop(t: Trainee, output: Path, logger: Logger, step: int, tokens_seen: int, last_good: Path | None, *,
          progress: bool, stop_after: int | None, label: str, heldout: HeldoutCheck | None = None) -> tuple[int, int, bool]:
    """Optimiser steps from `step` to the end (or to stop_after, or to the held-out check that stops the run),
    logging and checkpointing as the recipe says; returns (steps done, tokens seen, stopped by the check)."""
    recipe = t.recipe
    bar = progress_bar(progress and t.accelerator.is_main_process)
    task = bar.add_task(label, total=recipe.max_steps, completed=step, status="")
    end_step = recipe.max_steps if stop_after is None else min(recipe.max_steps, stop_after)
    stopped = False
    with bar:
        while step < end_step and not stopped:
            interrupts.check()  # a Ctrl-C a library swallowed during the last step stops the run here
            record = train_step(t, step, tokens_seen, last_good)
            step, tokens_seen = record["step"], record["tokens_seen"]
            if heldout is not None and heldout.due(step):  # every process checks alike, so all stop together
                check = heldout.run(t.accelerator.unwrap_model(t.model), step)
                record.update({"heldout": check, "heldout_pass@1": check["pass@1"]})
                stopped = check["stop"]
                t.accelerator.print(f"[{label}] step {step}: held-out pass@1 at T = {check['loops']} {check['pass@1']:.3f} "
                                    f"(target {check['target']:g}{'; stopping' if stopped else ''}; {check['seconds']:.1f} s)")
            if (step - 1) % recipe.log_every == 0 or step == end_step or "heldout" in record:
                logger.log(read_gate_means(record))
            else:
                record.pop(GATE_MEANS, None)
            bar.update(task, completed=step, status=status(record))
            # no checkpoint at the step a held-out check stopped: the run is exported next, and a checkpoint there
            # would let a kill before the export resume past the stop (the stop is not in the checkpoint); from the
            # one before, the resumed run redoes the same steps and stops at the same check
            if stopped:
                continue
            if (recipe.save_every and step % recipe.save_every == 0) or (step == end_step and step < recipe.max_steps):
                # this module's name, looked up at each save: tests wrap runner.write_checkpoint
                trainer_state = {"step": step, "tokens_seen": tokens_seen, "data": t.stream.state_dict()}
                last_good = write_checkpoint(t.accelerator, output, trainer_state, recipe.keep_checkpoints, last_good)
    return step, tokens_seen, stopped


def logged_checks(output: Path) -> list[dict]:
    """The held-out checks of a run, in order, from its metrics log."""
    path = output / "logs" / "metrics.jsonl"
    return [r["heldout"] for _, r in read_metrics(path)[0] if isinstance(r.get("heldout"), dict)] if path.exists() else []


def run_recipe(name: str | Recipe, from_model: str | None = None, output: str | Path = "runs/melt", *,
               overrides: dict | None = None, config_file: str | None = None, resume: bool = False,
               progress: bool = True, stop_after: int | None = None, label: str | None = None,
               push_to_hub: bool = False, hub_model_id: str | None = None, verify: bool = True) -> Path:
    """Python entry point (used by the CLI, `ablate` and the demo): resolve a recipe and train it.
    `label` names the run in progress lines (runs trained side by side must be told apart)."""
    from melt_eval.training.config import _check_keys, load_recipe

    if isinstance(name, Recipe):
        overrides = dict(overrides or {})
        if from_model is not None:
            overrides["from_model"] = from_model
        _check_keys(overrides, "overrides")
        recipe = Recipe(**{**name.to_dict(), **overrides}).validate()
    else:
        overrides = dict(overrides or {})
        if from_model is not None:
            overrides["from_model"] = from_model
        recipe = load_recipe(name, config_file=config_file, overrides=overrides)
    return train(recipe, output, resume=resume, progress=progress, stop_after=stop_after, label=label,
                 push_to_hub=push_to_hub, hub_model_id=hub_model_id, verify=verify)
