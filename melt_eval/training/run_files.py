"""The run directory's own files, as the runner writes them: what a run records and what `--resume` trusts.

A run directory must say, after any interruption, which recipe it runs, whether it finished and what
the teacher was, so that `--resume` continues exactly the same run and a second run is never written
over the first. runs.py reads these files for callers outside training; only this module writes them.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from melt_eval import float_path
from melt_eval.errors import UserError
from melt_eval.files import SUMS_FILE, TRAINING_META, write_json_atomic, write_sums, write_text_atomic
from melt_eval.provenance import git_state, package_versions
from melt_eval.training.checkpoints import checkpoint_dirs, remove_leftovers, resume_candidates
from melt_eval.training.config import EXECUTION_FIELDS, Recipe, parse_yaml

META_FILE = TRAINING_META  # melt_eval_training.json
# the run's own records beside the model, rewritten after the export (the model card too): not hashed
NOT_HASHED = {META_FILE, "recipe.yaml", "README.md", SUMS_FILE, ".melt-eval.lock"}
# keys that may differ when resuming (they do not change what the run computes)
RESUME_MUTABLE = {"save_every", "keep_checkpoints", "log_every", "tensorboard", "log_with"} | EXECUTION_FIELDS


def read_meta(run_dir: Path) -> dict | str | None:
    """The run's META_FILE as a dict; None if absent; a string saying what is wrong if unreadable."""
    path = run_dir / META_FILE
    if not path.is_file():
        return None
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return f"{path.name} is unreadable ({str(exc).splitlines()[0][:80]})"
    return meta if isinstance(meta, dict) else f"{path.name} is not a JSON object"


def code_version() -> dict:
    return {**git_state(), **package_versions(("torch", "transformers", "accelerate"))}


def saved_recipe(output: Path, meta: dict | str | None) -> tuple[Recipe, list[str]]:
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


def prepare_output(output: Path, recipe: Recipe, resume: bool, tidy: bool = True) -> tuple[Recipe, list[Path], list[str]]:
    """Check the output directory against --resume; return the recipe to run, the checkpoints to try
    loading (newest complete first) and notes for the user (what was skipped or recovered). `tidy` False: only
    check, removing no leftovers (`train --nproc-per-node` before its workers start)."""
    if not resume:
        if (output / "recipe.yaml").exists() or (output / META_FILE).exists() or checkpoint_dirs(output):
            raise UserError(f"{output} already holds a training run; pass --resume to continue it or choose another --output")
        return recipe, [], []
    meta = read_meta(output)
    if meta is None and not (output / "recipe.yaml").exists():
        raise UserError(f"--resume: {output} holds no training run (no recipe.yaml); start it without --resume")
    notes = [f"{meta}; ignoring it (it is rewritten now)"] if isinstance(meta, str) else []
    if isinstance(meta, dict) and meta.get("status") == "finished":
        raise UserError(f"--resume: the run in {output} has already finished; choose another --output for a new run")
    old, recipe_notes = saved_recipe(output, meta)
    notes += recipe_notes
    diff = [k for k in Recipe.field_names() if k not in RESUME_MUTABLE and getattr(old, k) != getattr(recipe, k)]
    if diff:
        detail = ", ".join(f"{k}: {getattr(old, k)!r} -> {getattr(recipe, k)!r}" for k in diff[:6])
        raise UserError(f"--resume must use the interrupted run's recipe; these keys differ ({detail}). Rerun the same command with --resume")
    if tidy:
        from accelerate import PartialState

        if PartialState().is_main_process:
            remove_leftovers(output)
    candidates, ckpt_notes = resume_candidates(output)
    return recipe, candidates, notes + ckpt_notes


def run_meta(recipe: Recipe, info: dict, world: int, mixed_precision: str, accum: int) -> dict:
    """META_FILE's contents while the run is going (`status` becomes "finished" at the export)."""
    return {"status": "running", "recipe": recipe.to_dict(), "phase": recipe.phase, "target": recipe.target,
            "teacher": info.get("teacher"), "teacher_path": info.get("teacher_path"), "from_model": info["from_model"],
            "from_path": info["from_path"],
            # False: `--no-verify` loaded --from (and the teacher) without their SHA256SUMS
            "checksums_checked": info.get("checksums_checked", True),
            "code": code_version(), "float_path": float_path.describe(), "world_size": world,
            "mixed_precision": mixed_precision, "grad_accum_steps": accum,
            # target exit_gate: the weights are those of from_model, trained by ITS recipe, with the gate fitted
            **({"exit_gate": "fitted", "model_recipe": info.get("model_recipe")} if recipe.target == "exit_gate" else {})}


def write_run_start(output: Path, recipe: Recipe, meta: dict) -> None:
    """recipe.yaml and META_FILE, before the first step (main process only)."""
    output.mkdir(parents=True, exist_ok=True)
    write_text_atomic(output / "recipe.yaml", yaml.safe_dump(recipe.to_dict(), sort_keys=False))
    write_json_atomic(output / META_FILE, meta)


def export(accelerator, model, tokenizer, output: Path, meta: dict) -> None:
    """The final model in HF format, loadable by MeltForCausalLM/LoopLMForCausalLM.from_pretrained."""
    from melt_eval.modeling.quiet import quiet_transformers

    accelerator.wait_for_everyone()
    state_dict = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        unwrapped = accelerator.unwrap_model(model)
        with quiet_transformers():
            unwrapped.save_pretrained(output, state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(output)
        # what `run` loads, hashed: it checks them before loading (melt_eval.files.verify_sums)
        write_sums(output, [p.name for p in output.iterdir() if p.is_file() and p.name not in NOT_HASHED])
        write_json_atomic(output / META_FILE, meta)
    accelerator.wait_for_everyone()
