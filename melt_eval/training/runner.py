"""The one recipe runner: MELT phase 1/2, the ablation rows, and plain LoopLM training.

Built on Hugging Face Accelerate, so the same code runs on a CPU, one GPU, or many GPUs
and nodes under `accelerate launch` (melt_eval/recipes/accelerate/fsdp.yaml). Accelerate owns
device placement, mixed precision, gradient synchronisation and the resumable state;
this file owns the MELT-specific parts: the student/teacher pair, alpha, the objective,
gradient accumulation to the recipe's token batch, logging and checkpoints.

Output directory layout:

    DIR/config.json, model.safetensors, tokenizer files   final model (HF format)
    DIR/melt_eval_training.json                           recipe, code version, teacher, status
    DIR/recipe.yaml                                       the fully resolved recipe
    DIR/checkpoints/step-000100/{state/, trainer_state.json}   resumable (Accelerate state + data position)
    DIR/logs/metrics.jsonl, DIR/logs/tb/                   per-step metrics, TensorBoard
    DIR/.melt-eval.lock                                    held while a run writes here (melt_eval.files.DirLock)

A checkpoint is written to checkpoints/.tmp-step-N, fsynced, then renamed to step-N, with
trainer_state.json (last) listing every state file and its size; `--resume` takes the newest
step-N whose files are all there at their sizes and that loads, naming any it skipped.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import time
from pathlib import Path

import torch
import yaml

from melt_eval.errors import UserError
from melt_eval.files import DirLock, fsync_dir, fsync_tree, remove_tree, write_json_atomic, write_text_atomic
from melt_eval.provenance import git_state, package_versions
from melt_eval.training.config import EXECUTION_FIELDS, Recipe, parse_yaml
from melt_eval.training.data import DataStream, bucket, prompt_length
from melt_eval.training.losses import objective

META_FILE = "melt_eval_training.json"
# keys that may differ when resuming (they do not change what the run computes)
RESUME_MUTABLE = {"save_every", "keep_checkpoints", "log_every", "tensorboard"} | EXECUTION_FIELDS
SHAPE_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "total_ut_steps")


class NonFiniteLoss(UserError):
    """The loss or gradient norm stopped being finite; the weights were not updated."""


# --- models -------------------------------------------------------------------------------------


def lr_factor(step: int, recipe: Recipe) -> float:
    """Linear warmup over `warmup_steps`, then cosine decay to `min_lr_ratio` at `max_steps`."""
    if recipe.warmup_steps and step < recipe.warmup_steps:
        return (step + 1) / recipe.warmup_steps
    span = max(1, recipe.max_steps - recipe.warmup_steps)
    progress = min(1.0, (step - recipe.warmup_steps) / span)
    return recipe.min_lr_ratio + (1 - recipe.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def check_teacher(student, teacher) -> None:
    """Refuse a teacher whose architecture differs from the student's (before any compute)."""
    bad = [f"{k}: student {getattr(student.config, k, None)} vs teacher {getattr(teacher.config, k, None)}"
           for k in SHAPE_FIELDS if getattr(student.config, k, None) != getattr(teacher.config, k, None)]
    t_shapes = {k: v.shape for k, v in teacher.state_dict().items()}
    bad += [f"{k}: student {tuple(v.shape)} vs teacher {tuple(t_shapes[k])}"
            for k, v in student.state_dict().items() if k in t_shapes and t_shapes[k] != v.shape][:5]
    if bad:
        raise UserError("the teacher does not match the student (" + "; ".join(bad) + "); pass the LoopLM the student was made from with --teacher")


def _recorded_teacher(model_dir: Path) -> str | None:
    meta = _read_meta(model_dir)
    return meta.get("teacher") if isinstance(meta, dict) else None


def _read_meta(run_dir: Path) -> dict | str | None:
    """The run's META_FILE as a dict; None if absent; a string saying what is wrong if unreadable."""
    path = run_dir / META_FILE
    if not path.is_file():
        return None
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return f"{path.name} is unreadable ({str(exc).splitlines()[0][:80]})"
    return meta if isinstance(meta, dict) else f"{path.name} is not a JSON object"


def build_models(recipe: Recipe):
    """(student, teacher or None, tokenizer, provenance dict) for the recipe."""
    from melt_eval.modeling import LoopLMConfig, LoopLMForCausalLM, MeltForCausalLM, load_model
    from melt_eval.modeling.loading import checkpoint_model_type, load_tokenizer, resolve_model_dir

    if not recipe.from_model:
        raise UserError("no starting model: pass --from MODEL (a registry name or checkpoint directory)")
    from_dir = resolve_model_dir(recipe.from_model)
    info = {"from_model": recipe.from_model, "from_path": str(from_dir)}
    kind = checkpoint_model_type(from_dir)

    if recipe.target == "looplm":
        if kind != "ouro":
            raise UserError(f"target looplm trains an Ouro-style LoopLM; {recipe.from_model} is {kind!r}")
        if recipe.from_scratch:  # a fresh LoopLM with the architecture (and tokenizer) of from_model
            config = LoopLMConfig.from_pretrained(from_dir)
            for key, value in recipe.model_overrides.items():
                if not hasattr(config, key):
                    raise UserError(f"model_overrides: {key!r} is not a LoopLM config field")
                setattr(config, key, value)
            torch.manual_seed(recipe.seed)
            student = LoopLMForCausalLM(config)
            tokenizer = load_tokenizer(from_dir)
        else:
            if recipe.model_overrides:
                raise UserError("model_overrides only apply with from_scratch: true")
            student, tokenizer = load_model(from_dir)
        return student, None, tokenizer, info

    if recipe.from_scratch or recipe.model_overrides:
        raise UserError("from_scratch/model_overrides are for target looplm; MELT starts from a trained model")
    model, tokenizer = load_model(from_dir)
    teacher = None
    teacher_ref = recipe.teacher
    if isinstance(model, MeltForCausalLM):
        if teacher_ref is None:
            teacher_ref = _recorded_teacher(from_dir)
        if teacher_ref is None and recipe.needs_teacher():
            raise UserError(f"{recipe.from_model} is a MELT checkpoint with no recorded teacher; pass --teacher <the original LoopLM>")
        student = model
        if model.config.gate != recipe.gate:
            info["gate_note"] = f"continuing the checkpoint's {model.config.gate!r} gate (recipe gate {recipe.gate!r} ignored)"
    else:
        if recipe.phase == 2:
            raise UserError(f"phase 2 continues a phase-1 MELT checkpoint; {recipe.from_model} is a LoopLM (run phase 1 first)")
        student = MeltForCausalLM.from_looplm(model, gate=recipe.gate, seed=recipe.gate_seed, ema_decay=recipe.ema_decay)
        if teacher_ref is None:
            teacher_ref, teacher = recipe.from_model, model  # the frozen copy of the starting LoopLM
            info["teacher_path"] = str(from_dir)
    if recipe.needs_teacher() and teacher is None:
        teacher_dir = resolve_model_dir(teacher_ref)
        if checkpoint_model_type(teacher_dir) != "ouro":
            raise UserError(f"the teacher must be a LoopLM (Ouro) checkpoint; {teacher_ref} is {checkpoint_model_type(teacher_dir)!r}")
        teacher, _ = load_model(teacher_dir)
        info["teacher_path"] = str(teacher_dir)
    info["teacher"] = teacher_ref
    if teacher is not None:
        check_teacher(student, teacher)
        teacher.eval().requires_grad_(False)
    elif model is not student:
        del model  # no KD and no alignment: the starting LoopLM is not needed any more
    return student, teacher, tokenizer, info


def param_groups(model, recipe: Recipe) -> list[dict]:
    """Two groups: MELT's gate parameters at gate_lr, everything else at lr."""
    gate = list(model.gate_parameters()) if hasattr(model, "gate_parameters") else []
    gate_ids = {id(p) for p in gate}
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in gate_ids]
    groups = [{"params": rest, "lr": recipe.lr, "base_lr": recipe.lr, "name": "base"}]
    if gate:
        groups.append({"params": gate, "lr": recipe.gate_lr, "base_lr": recipe.gate_lr, "name": "gate"})
    return groups


# --- bookkeeping ------------------------------------------------------------------------------------


def code_version() -> dict:
    return {**git_state(), **package_versions(("torch", "transformers", "accelerate"))}


# --- checkpoints ---------------------------------------------------------------------------------


def _checkpoints(output: Path) -> list[Path]:
    """checkpoints/step-N directories, oldest first (complete or not: see `_checkpoint_problem`)."""
    found = [p for p in (output / "checkpoints").glob("step-*") if p.name[5:].isdigit() and p.is_dir()]
    return sorted(found, key=lambda p: int(p.name[5:]))


def _trainer_state(ckpt: Path) -> dict | str:
    """A checkpoint's trainer_state.json, or a string saying why it cannot be used."""
    try:
        state = json.loads((ckpt / "trainer_state.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        return "no trainer_state.json"
    except (OSError, ValueError):
        return "trainer_state.json is cut or corrupt"
    if not isinstance(state, dict) or not all(k in state for k in ("step", "tokens_seen", "data")):
        return "trainer_state.json is incomplete"
    if state["step"] != int(ckpt.name[5:]):
        return f"trainer_state.json is for step {state['step']}"
    return state


def _checkpoint_problem(ckpt: Path) -> str | None:
    """None if every file the checkpoint listed is there at its size, else what is wrong."""
    state = _trainer_state(ckpt)
    if isinstance(state, str):
        return state
    files = state.get("files")
    if not isinstance(files, dict):  # written before checkpoints listed their files: loading is the test
        return None if (ckpt / "state").is_dir() and any((ckpt / "state").iterdir()) else "state/ is empty"
    for rel, size in files.items():
        path = ckpt / rel
        if not path.is_file():
            return f"{rel} is missing"
        if path.stat().st_size != size:
            return f"{rel} has {path.stat().st_size:,} of {size:,} bytes"
    return None


def write_checkpoint(accelerator, output: Path, trainer_state: dict, keep: int, last_good: Path | None) -> Path:
    """checkpoints/step-N, atomically: saved to a hidden temporary directory, trainer_state.json
    (with the list of files and sizes) written last, everything fsynced, then renamed into place.
    An interruption at any point leaves the previous checkpoints intact and no step-N that is not whole."""
    root = output / "checkpoints"
    final = root / f"step-{trainer_state['step']:06d}"
    tmp = root / f".tmp-{final.name}"
    main = accelerator.is_main_process
    if main:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left by an interrupted save
    accelerator.wait_for_everyone()
    try:
        accelerator.save_state(str(tmp / "state"))
        accelerator.wait_for_everyone()
        if main:
            files = {p.relative_to(tmp).as_posix(): p.stat().st_size for p in sorted((tmp / "state").rglob("*")) if p.is_file()}
            write_json_atomic(tmp / "trainer_state.json", {**trainer_state, "files": files})
            fsync_tree(tmp)
            if final.exists():  # an incomplete one skipped by --resume, now redone
                remove_tree(final)
            os.replace(tmp, final)
            fsync_dir(root)
    except Exception as exc:  # a full disk shows as OSError or as torch's RuntimeError
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
        where = f"the last complete checkpoint is {last_good.name}" if last_good else "no checkpoint was written yet"
        raise UserError(f"could not write checkpoint {final.name} ({str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__}); "
                        f"{where}; free disk space if it is full, then rerun with --resume") from None
    if main:
        _prune(output, trainer_state["step"], keep)
    accelerator.wait_for_everyone()
    return final


def _prune(output: Path, step: int, keep: int) -> None:
    """Keep the newest `keep` complete checkpoints up to `step`. The others go: older ones, incomplete
    ones, and any beyond `step` (left by a run that resumed from before them)."""
    complete = [c for c in _checkpoints(output) if int(c.name[5:]) <= step and _checkpoint_problem(c) is None]
    kept = set(complete[-keep:])
    for ckpt in _checkpoints(output):
        if ckpt not in kept:
            remove_tree(ckpt)


def _remove_leftovers(output: Path) -> None:
    """What an interrupted save, deletion or atomic write left (the main process, under the lock)."""
    root = output / "checkpoints"
    for leftover in [*root.glob(".tmp-step-*"), *root.glob(".trash-*")]:
        shutil.rmtree(leftover, ignore_errors=True)
    for leftover in [*output.glob(".*.tmp"), *output.glob("logs/.*.tmp")]:
        leftover.unlink(missing_ok=True)


def _resume_candidates(output: Path) -> tuple[list[Path], list[str]]:
    """Complete checkpoints, newest first, and a note naming the incomplete ones newer than those."""
    complete, skipped = [], []
    for ckpt in reversed(_checkpoints(output)):
        problem = _checkpoint_problem(ckpt)
        if problem is None:
            complete.append(ckpt)
        elif not complete:
            skipped.append(f"{ckpt.name} ({problem})")
    notes = [f"skipping incomplete checkpoint{'s' if len(skipped) > 1 else ''} {'; '.join(skipped)}"] if skipped else []
    return complete, notes


def _load_checkpoint(accelerator, stream, output: Path, candidates: list[Path]) -> tuple[int, int, Path | None]:
    """Load the newest checkpoint that loads; returns (step, tokens seen, checkpoint)."""
    failed = []
    for ckpt in candidates:
        state = _trainer_state(ckpt)
        try:
            accelerator.load_state(str(ckpt / "state"))
        except Exception as exc:  # corrupt bytes its size did not betray (torch, safetensors, pickle errors)
            failed.append(f"{ckpt.name} ({type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''})")
            continue
        stream.load_state_dict(state["data"])
        if failed:
            accelerator.print(f"skipping checkpoint{'s' if len(failed) > 1 else ''} that did not load: {'; '.join(failed)}")
        accelerator.print(f"resuming {output} at step {state['step']} from {ckpt.name}")
        return state["step"], state["tokens_seen"], ckpt
    if failed:  # the model may hold part of a failed load: do not train on from it
        raise UserError(f"--resume: no checkpoint in {output / 'checkpoints'} loads ({'; '.join(failed)}); "
                        "move them away to restart from step 0, or train into a new --output")
    accelerator.print(f"no complete checkpoint in {output}; starting from step 0")
    return 0, 0, None


def read_metrics(path: Path) -> tuple[list[tuple[str, dict]], int]:
    """A metrics.jsonl's records as (line, record), in order, and how many lines were cut (an
    interrupted write leaves a last line that does not parse)."""
    records, cut = [], 0
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            cut += bool(line.strip())
            continue
        if isinstance(record, dict):
            records.append((line, record))
    return records, cut


class Logger:
    """Per-step metrics to JSONL and TensorBoard (main process only)."""

    def __init__(self, output: Path, enabled: bool, tensorboard: bool, resume_step: int) -> None:
        self.enabled = enabled
        self.path = output / "logs" / "metrics.jsonl"
        self.tb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.note = None
        if self.path.exists():  # drop records of steps the resumed run will redo, and lines cut by an interruption
            records, cut = read_metrics(self.path)
            keep = [line for line, record in records if isinstance(record.get("step"), int) and record["step"] <= resume_step]
            write_text_atomic(self.path, "".join(line + "\n" for line in keep))
            if cut:
                self.note = f"dropped {cut} cut line{'s' if cut > 1 else ''} of {self.path}"
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(output / "logs" / "tb"), purge_step=resume_step + 1 if resume_step else None)

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tb is not None:
            step = record["step"]
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "step" and math.isfinite(value):
                    self.tb.add_scalar(key.replace(".", "/"), value, step)
            for name, means in (record.get("gate_mean") or {}).items():
                for t, v in enumerate(means):
                    if v is not None:
                        self.tb.add_scalar(f"gate/{name}/loop{t + 1}", v, step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


# --- the run -------------------------------------------------------------------------------------


def _saved_recipe(output: Path, meta: dict | str | None) -> tuple[Recipe, list[str]]:
    """The interrupted run's recipe: recipe.yaml, or the copy in META_FILE where recipe.yaml is cut or corrupt."""
    found, problems = [], []
    try:
        raw = parse_yaml((output / "recipe.yaml").read_text(encoding="utf-8"), "recipe.yaml")
        if not isinstance(raw, dict):
            raise UserError("recipe.yaml is not a mapping")
        found.append(("recipe.yaml", raw))
    except (OSError, ValueError, UserError) as exc:
        problems.append("recipe.yaml is missing" if isinstance(exc, FileNotFoundError) else f"recipe.yaml is unreadable ({exc})")
    if isinstance(meta, dict) and isinstance(meta.get("recipe"), dict):
        found.append((META_FILE, meta["recipe"]))
    names = set(Recipe.field_names())
    # a file cut at a line boundary still parses: prefer the copy that holds the most recipe keys
    found = [(origin, raw) for origin, raw in found if set(raw) <= names]
    if not found:
        detail = "; ".join(problems) or "it has no recipe"
        raise UserError(f"--resume: cannot read the recipe of the run in {output} ({detail}); start a new run in another --output")
    origin, raw = max(found, key=lambda item: len(item[1]))
    notes = [] if origin == "recipe.yaml" else [
        f"{problems[0] if problems else 'recipe.yaml is incomplete'}; using the recipe recorded in {META_FILE}"]
    try:
        return Recipe(**raw), notes
    except TypeError as exc:
        raise UserError(f"--resume: the recipe recorded in {output / origin} is unusable ({exc})") from None


def _prepare_output(output: Path, recipe: Recipe, resume: bool) -> tuple[Recipe, list[Path], list[str]]:
    """Check the output directory against --resume; return the recipe to run, the checkpoints to try
    loading (newest complete first) and notes for the user (what was skipped or recovered)."""
    if not resume:
        if (output / "recipe.yaml").exists() or (output / META_FILE).exists() or _checkpoints(output):
            raise UserError(f"{output} already holds a training run; pass --resume to continue it or choose another --output")
        return recipe, [], []
    meta = _read_meta(output)
    if meta is None and not (output / "recipe.yaml").exists():
        raise UserError(f"--resume: {output} holds no training run (no recipe.yaml); start it without --resume")
    notes = [f"{meta}; ignoring it (it is rewritten now)"] if isinstance(meta, str) else []
    if isinstance(meta, dict) and meta.get("status") == "finished":
        raise UserError(f"--resume: the run in {output} has already finished; choose another --output for a new run")
    old, recipe_notes = _saved_recipe(output, meta)
    notes += recipe_notes
    diff = [k for k in Recipe.field_names() if k not in RESUME_MUTABLE and getattr(old, k) != getattr(recipe, k)]
    if diff:
        detail = ", ".join(f"{k}: {getattr(old, k)!r} -> {getattr(recipe, k)!r}" for k in diff[:6])
        raise UserError(f"--resume must use the interrupted run's recipe; these keys differ ({detail}). Rerun the same command with --resume")
    from accelerate import PartialState

    if PartialState().is_main_process:
        _remove_leftovers(output)
    candidates, ckpt_notes = _resume_candidates(output)
    return recipe, candidates, notes + ckpt_notes


def train(recipe: Recipe, output: str | Path, *, resume: bool = False, progress: bool = True, stop_after: int | None = None,
          label: str | None = None) -> Path:
    """Run a recipe; returns the output directory (the final model is written there).

    The output directory is locked for the run (melt_eval.files.DirLock): a second `train` into it
    is refused with the PID of the first. stop_after: stop (with a resumable checkpoint) once this
    many optimiser steps are done, as if interrupted; used by tests of --resume.
    """
    from accelerate import PartialState

    output = Path(output).expanduser().resolve()
    # the main process holds the lock for all of them (other ranks write only checkpoint shards)
    lock = DirLock(output, "training run") if PartialState().is_main_process else contextlib.nullcontext()
    with lock:
        return _train(recipe, output, resume=resume, progress=progress, stop_after=stop_after, label=label)


@torch.enable_grad()  # whatever the caller's mode (an evaluation earlier in the process may have turned it off)
def _train(recipe: Recipe, output: Path, *, resume: bool, progress: bool, stop_after: int | None,
           label: str | None = None) -> Path:
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    recipe, candidates, notes = _prepare_output(output, recipe, resume)
    mp = recipe.mixed_precision
    if mp == "auto":
        mp = "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "no"
    accelerator = Accelerator(mixed_precision=mp)
    set_seed(recipe.seed)
    main = accelerator.is_main_process
    for note in notes:
        accelerator.print(f"note: {note}")

    student, teacher, tokenizer, info = build_models(recipe)
    loops = student.config.total_ut_steps
    if recipe.loop_ce_weights and len(recipe.loop_ce_weights) != loops:
        raise UserError(f"loop_ce_weights has {len(recipe.loop_ce_weights)} weights; {recipe.from_model} runs "
                        f"T = {loops} loops: give one weight per loop")
    if main and info.get("gate_note"):
        accelerator.print(f"note: {info['gate_note']}")
    # Ouro's early-exit gate is never used (all T loops always run): freeze it so that DDP/FSDP
    # see no parameter without a gradient.
    student.model.early_exit_gate.requires_grad_(False)
    student.train()
    if recipe.gradient_checkpointing:
        student.gradient_checkpointing_enable()
    per_token = recipe.compile and recipe.target == "melt" and recipe.chunk_size == 1
    if per_token:  # one compiled function per token: every token has the same shapes
        student.model.compile_token_step()
    elif recipe.compile:
        student.model.compile_layer_step()
    # a compiled layer step recompiles for every new chunk shape: pad rows to whole chunks
    pad_multiple = recipe.chunk_size if recipe.compile and recipe.chunk_size and not per_token else 1
    optimizer = torch.optim.AdamW(
        param_groups(student, recipe), betas=tuple(recipe.adam_betas), eps=recipe.adam_eps, weight_decay=recipe.weight_decay
    )
    model, optimizer = accelerator.prepare(student, optimizer)
    if teacher is not None:
        teacher.to(accelerator.device, dtype=torch.bfloat16 if mp == "bf16" else torch.float32)

    world = accelerator.num_processes
    stream = DataStream(recipe.data, tokenizer, recipe.seq_len, seed=recipe.seed, shuffle_buffer=recipe.shuffle_buffer,
                        rank=accelerator.process_index, world_size=world, overlong=recipe.overlong)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    accum = recipe.grad_accum_steps(world)

    start_step, tokens_seen, last_good = 0, 0, None
    if resume:
        start_step, tokens_seen, last_good = _load_checkpoint(accelerator, stream, output, candidates)

    meta = {"status": "running", "recipe": recipe.to_dict(), "phase": recipe.phase, "target": recipe.target,
            "teacher": info.get("teacher"), "teacher_path": info.get("teacher_path"), "from_model": info["from_model"],
            "from_path": info["from_path"], "code": code_version(), "world_size": world, "mixed_precision": mp,
            "grad_accum_steps": accum}
    if main:
        output.mkdir(parents=True, exist_ok=True)
        write_text_atomic(output / "recipe.yaml", yaml.safe_dump(recipe.to_dict(), sort_keys=False))
        write_json_atomic(output / META_FILE, meta)
    logger = Logger(output, main, recipe.tensorboard, start_step)
    if logger.note:
        accelerator.print(f"note: {logger.note}")

    learned_gate = any(True for _ in student.gate_parameters()) if hasattr(student, "gate_parameters") else False
    step = start_step

    def save_checkpoint() -> Path:
        trainer_state = {"step": step, "tokens_seen": tokens_seen, "data": stream.state_dict()}
        return write_checkpoint(accelerator, output, trainer_state, recipe.keep_checkpoints, last_good)

    bar = _progress(progress and main)
    default_label = f"{recipe.target} phase {recipe.phase}" if recipe.target == "melt" else "looplm"
    task = bar.add_task(label or default_label, total=recipe.max_steps, completed=start_step, status="")
    end_step = recipe.max_steps if stop_after is None else min(recipe.max_steps, stop_after)
    try:
        with bar:
            while step < end_step:
                t0 = time.perf_counter()
                alpha = recipe.alpha(step)
                factor = lr_factor(step, recipe)
                for group in optimizer.param_groups:
                    group["lr"] = group["base_lr"] * factor
                batches = bucket([stream.next() for _ in range(recipe.micro_batch_size * accum)], recipe.micro_batch_size, pad_id, pad_multiple)
                counts = torch.tensor([sum(float(b["loss_mask"][:, 1:].sum()) for b in batches),
                                       sum(float(b["attention_mask"].sum()) for b in batches),
                                       sum(b["attention_mask"].numel() for b in batches)], device=accelerator.device)
                n_loss, n_tok, n_slots = accelerator.reduce(counts, reduction="sum").tolist()
                want_states = recipe.needs_loop_states() or (learned_gate and step % recipe.log_every == 0)
                parts: dict[str, float] = {}
                gate_means = None
                for i, batch in enumerate(batches):
                    batch = {k: v.to(accelerator.device) for k, v in batch.items()}
                    sync = contextlib.nullcontext() if i == accum - 1 else accelerator.no_sync(model)
                    with sync:
                        terms, out = forward_objective(model, teacher, batch, recipe, step, n_loss_tokens=n_loss,
                                                       n_tokens=n_tok, output_loop_states=want_states,
                                                       teacher_autocast=accelerator.autocast)
                        # every process divided by the global token count; DDP averages gradients over processes
                        accelerator.backward(terms.total * world)
                    for k, v in terms.parts.items():
                        parts[k] = parts.get(k, 0.0) + v
                    parts["loss"] = parts.get("loss", 0.0) + float(terms.total.detach())
                    if getattr(out, "gate_means", None) is not None:
                        gate_means = out.gate_means
                    del out, terms
                reduced = accelerator.reduce(torch.tensor([parts[k] for k in sorted(parts)], device=accelerator.device), reduction="sum")
                parts = dict(zip(sorted(parts), reduced.tolist()))
                if not math.isfinite(parts["loss"]):
                    _stop_nonfinite("loss", step, parts, last_good, optimizer)
                grad_norm = float(accelerator.clip_grad_norm_(model.parameters(), recipe.grad_clip))
                if not math.isfinite(grad_norm):
                    _stop_nonfinite("gradient norm", step, parts, last_good, optimizer)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                step += 1
                tokens_seen += int(n_tok)
                dt = time.perf_counter() - t0
                record = {"step": step, **parts, "alpha": alpha, "grad_norm": grad_norm, "tokens": int(n_tok),
                          "padding_fraction": 1.0 - n_tok / max(n_slots, 1.0),
                          "overlong_truncated": stream.truncated, "overlong_dropped": stream.dropped,
                          "tokens_seen": tokens_seen, "tokens_per_s": n_tok / dt, "step_time_s": dt}
                for group in optimizer.param_groups:
                    record[f"lr.{group['name']}"] = group["lr"]
                if gate_means is not None:
                    record["gate_mean"] = {f"layer{i}": [None if math.isnan(v) else round(v, 5) for v in row]
                                           for i, row in enumerate(gate_means.tolist())}
                    valid = gate_means[~torch.isnan(gate_means)]
                    record["gate_mean_all"] = float(valid.mean()) if valid.numel() else float("nan")
                if (step - 1) % recipe.log_every == 0 or step == end_step:
                    logger.log(record)
                bar.update(task, completed=step, status=_status(record))
                if (recipe.save_every and step % recipe.save_every == 0) or (step == end_step and step < recipe.max_steps):
                    last_good = save_checkpoint()
    finally:
        logger.close()

    if step < recipe.max_steps:  # stopped early on purpose (stop_after): resumable, not finished
        return output
    _export(accelerator, model, tokenizer, output, {**meta, "status": "finished", "steps": step, "tokens_seen": tokens_seen})
    return output


def forward_objective(model, teacher, batch: dict, recipe: Recipe, step: int, *, n_loss_tokens: float, n_tokens: float,
                      output_loop_states: bool | None = None, teacher_autocast=contextlib.nullcontext):
    """One micro-batch through student (and teacher) and the recipe's objective at optimiser step `step`.

    Returns (LossTerms, student output). The student runs chunk-wise at the step's alpha; the
    teacher (the LoopLM, so chunking does not matter for it) runs without gradients. Neither
    builds [B, L, V] logits: the objective computes them a block of loss rows at a time.
    """
    if output_loop_states is None:
        output_loop_states = recipe.needs_loop_states()
    ids, attn = batch["input_ids"], batch["attention_mask"]
    align = recipe.align_beta > 0
    teacher_out = None
    if teacher is not None and (recipe.kd or align):
        with torch.no_grad(), teacher_autocast():
            teacher_out = teacher(ids, attention_mask=attn, output_loop_states=recipe.kd, output_attn_outputs=align,
                                  compute_logits=False)

    def loss_fn(student_head, out):  # runs inside the student's forward (FSDP-gathered weights, autocast)
        return objective(out, teacher_out, ids, batch["loss_mask"], attn, kd=recipe.kd and teacher_out is not None,
                         student_head=student_head, teacher_head=teacher.lm_head if teacher is not None else None,
                         kd_beta=recipe.kd_beta, kd_temperature=recipe.kd_temperature, ce_weight=recipe.ce_weight,
                         loop_weights=recipe.loop_ce_weights,
                         align_beta=recipe.align_beta if teacher_out is not None else 0.0,
                         n_loss_tokens=n_loss_tokens, n_tokens=n_tokens)

    chunk_size, first_chunk = _chunks(recipe, batch)
    out = model(ids, attention_mask=attn, chunk_size=chunk_size, first_chunk=first_chunk, alpha=recipe.alpha(step),
                output_loop_states=output_loop_states, output_attn_outputs=align, compute_logits=False, loss_fn=loss_fn)
    return out.loss_terms, out


def _chunks(recipe: Recipe, batch: dict) -> tuple[int | None, int]:
    """(chunk size, first chunk) of the student's forward."""
    if recipe.target != "melt":
        return None, 0  # a LoopLM's per-loop cache makes chunking irrelevant: one parallel pass
    if not recipe.chunk_size:
        return batch["input_ids"].shape[1], 0  # 0 = C = L, fully parallel
    return recipe.chunk_size, prompt_length(batch["loss_mask"]) if recipe.prompt_as_one_chunk else 0


def _stop_nonfinite(what: str, step: int, parts: dict, last_good: Path | None, optimizer) -> None:
    optimizer.zero_grad(set_to_none=True)
    terms = ", ".join(f"{k}={v:.4g}" for k, v in sorted(parts.items()))
    where = f"the last good checkpoint is {last_good}; continue from it with --resume" if last_good else "no checkpoint was written yet"
    raise NonFiniteLoss(
        f"non-finite {what} at step {step + 1} ({terms}); stopped before updating the weights; {where} "
        "(lower lr/gate_lr or check the data)"
    )


def _export(accelerator, model, tokenizer, output: Path, meta: dict) -> None:
    """The final model in HF format, loadable by MeltForCausalLM/LoopLMForCausalLM.from_pretrained."""
    from melt_eval.modeling.quiet import quiet_transformers

    accelerator.wait_for_everyone()
    state_dict = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        unwrapped = accelerator.unwrap_model(model)
        with quiet_transformers():
            unwrapped.save_pretrained(output, state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(output)
        write_json_atomic(output / META_FILE, meta)
    accelerator.wait_for_everyone()


def _status(record: dict) -> str:
    bits = [f"loss {record['loss']:.4f}"]
    for k in ("kd", "sft", "align"):
        if k in record:
            bits.append(f"{k} {record[k]:.4f}")
    bits.append(f"α {record['alpha']:.2f}")
    if "gate_mean_all" in record:
        bits.append(f"z̄ {record['gate_mean_all']:.3f}")
    bits.append(f"{record['tokens_per_s']:.0f} tok/s")
    return " · ".join(bits)


def _progress(enabled: bool):
    from melt_eval.progress import training_progress

    return training_progress(enabled)  # a bar on a terminal, plain lines at a fixed cadence in a log


def run_recipe(name: str | Recipe, from_model: str | None = None, output: str | Path = "runs/melt", *,
               overrides: dict | None = None, config_file: str | None = None, resume: bool = False,
               progress: bool = True, stop_after: int | None = None, label: str | None = None) -> Path:
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
    return train(recipe, output, resume=resume, progress=progress, stop_after=stop_after, label=label)
