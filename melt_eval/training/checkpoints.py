"""Resumable checkpoints that an interruption at any instant cannot corrupt.

A checkpoint is written to checkpoints/.tmp-step-N, fsynced, then renamed to step-N, with
trainer_state.json (last) listing every state file, its size and its SHA-256. A step-N is only trusted if
every listed file is there at its size, and only used once its files match their hashes (bytes flipped on
disk keep the sizes) and it loads: a crash, a full disk, a kill in the middle of a save or a damaged
file must cost at most the steps since the previous checkpoint, never the run.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import sys
from pathlib import Path

from melt_eval.errors import UserError
from melt_eval.files import fsync_dir, fsync_tree, hash_mismatches, remove_tree, sha256_file, write_json_atomic


def checkpoint_dirs(output: Path) -> list[Path]:
    """checkpoints/step-N directories, oldest first (complete or not: see `checkpoint_problem`)."""
    found = [p for p in (output / "checkpoints").glob("step-*") if p.name[5:].isdigit() and p.is_dir()]
    return sorted(found, key=lambda p: int(p.name[5:]))


def read_trainer_state(ckpt: Path) -> dict | str:
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


def checkpoint_problem(ckpt: Path) -> str | None:
    """None if every file the checkpoint listed is there at its size, else what is wrong."""
    state = read_trainer_state(ckpt)
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
            paths = [p for p in sorted((tmp / "state").rglob("*")) if p.is_file()]
            files = {p.relative_to(tmp).as_posix(): p.stat().st_size for p in paths}
            sha256 = {p.relative_to(tmp).as_posix(): sha256_file(p) for p in paths}
            write_json_atomic(tmp / "trainer_state.json", {**trainer_state, "world_size": accelerator.num_processes,
                                                           "files": files, "sha256": sha256})
            fsync_tree(tmp)
            if final.exists():  # an incomplete one skipped by --resume, now redone
                remove_tree(final)
            os.replace(tmp, final)
            fsync_dir(root)
    except Exception as exc:  # a full disk shows as OSError or as torch's RuntimeError
        full = _disk_full(exc, root)  # asked before the partial save is removed (which frees the space)
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
        where = f"the last complete checkpoint is {last_good.name}" if last_good else "no checkpoint was written yet"
        said = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        if full:
            raise UserError(f"could not write checkpoint {final.name}: no space left on device in {root}; {where}; "
                            "free disk space, then rerun with --resume") from None
        raise UserError(f"could not write checkpoint {final.name} ({said}); "
                        f"{where}; free disk space if it is full, then rerun with --resume") from None
    if main:
        prune(output, trainer_state["step"], keep)
    accelerator.wait_for_everyone()
    return final


def _disk_full(exc: BaseException, root: Path) -> bool:
    """Whether a failed save ran out of disk: an ENOSPC/EDQUOT anywhere in the exception's chain, or (torch's
    writer says only "unexpected pos ..." or "file write failed") less than a MiB left where it wrote."""
    seen = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        seen = seen.__cause__ or seen.__context__
    try:
        return shutil.disk_usage(root).free < (1 << 20)
    except OSError:
        return False


def prune(output: Path, step: int, keep: int) -> None:
    """Keep the newest `keep` complete checkpoints up to `step`. The others go: older ones, incomplete
    ones, and any beyond `step` (left by a run that resumed from before them)."""
    complete = [c for c in checkpoint_dirs(output) if int(c.name[5:]) <= step and checkpoint_problem(c) is None]
    kept = set(complete[-keep:])
    for ckpt in checkpoint_dirs(output):
        if ckpt not in kept:
            remove_tree(ckpt)


def remove_leftovers(output: Path) -> None:
    """What an interrupted save, deletion or atomic write left (the main process, under the lock)."""
    root = output / "checkpoints"
    for leftover in [*root.glob(".tmp-step-*"), *root.glob(".trash-*")]:
        shutil.rmtree(leftover, ignore_errors=True)
    for leftover in [*output.glob(".*.tmp"), *output.glob("logs/.*.tmp")]:
        leftover.unlink(missing_ok=True)


def resume_candidates(output: Path) -> tuple[list[Path], list[str]]:
    """Complete checkpoints, newest first, and a note naming the incomplete ones newer than those."""
    complete, skipped = [], []
    for ckpt in reversed(checkpoint_dirs(output)):
        problem = checkpoint_problem(ckpt)
        if problem is None:
            complete.append(ckpt)
        elif not complete:
            skipped.append(f"{ckpt.name} ({problem})")
    notes = [f"skipping incomplete checkpoint{'s' if len(skipped) > 1 else ''} {'; '.join(skipped)}"] if skipped else []
    return complete, notes


def load_checkpoint(accelerator, stream, output: Path, candidates: list[Path], recipe=None,
                    verify: bool = True) -> tuple[int, int, Path | None]:
    """Load the newest checkpoint that loads; returns (step, tokens seen, checkpoint). With `recipe`, one written
    by another number of processes is refused unless the step's global batch is the same (launch.check_resume_world).
    `verify`: a checkpoint whose trainer_state.json has no SHA-256 map (this harness writes one with every
    checkpoint) is refused in one line, never loaded unchecked; False (`train --resume --no-verify`) loads it,
    loading as the test."""
    failed = []
    for ckpt in candidates:
        state = read_trainer_state(ckpt)
        if recipe is not None:
            from melt_eval.training.launch import check_resume_world

            check_resume_world(ckpt, state.get("world_size", 1), accelerator.num_processes, recipe)
        hashes = state.get("sha256")
        if not isinstance(hashes, dict) and verify:
            raise UserError(f"--resume: {ckpt} has no SHA-256 sums in its trainer_state.json, so its files cannot be "
                            "checked; restore it, move it away to resume from an earlier checkpoint, or pass "
                            "--no-verify to resume from it unchecked")
        damaged = hash_mismatches(ckpt, hashes) if isinstance(hashes, dict) else []
        if damaged:
            failed.append(f"{ckpt.name} ({'; '.join(damaged[:3])}: damaged)")
            continue
        try:
            accelerator.load_state(str(ckpt / "state"))
        except Exception as exc:  # corrupt bytes its size did not betray (torch, safetensors, pickle errors)
            if ".k_proj.weight" in str(exc):  # a state saved before k_proj|v_proj, gate_proj|up_proj were held merged
                failed.append(f"{ckpt.name} (its model state keeps k_proj and v_proj apart: written by a melt-eval "
                              "before 2026-11-28, which must resume it)")
            elif ".melt_gate.a_proj.weight" in str(exc):  # before MELT's W_z|U_z were held merged
                failed.append(f"{ckpt.name} (its model state keeps the gate's a_proj and h_proj apart: written by a "
                              "melt-eval before 2026-11-29, which must resume it)")
            else:
                failed.append(f"{ckpt.name} ({type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''})")
            continue
        stream.load_state_dict(state["data"])
        if failed and accelerator.is_main_process:  # a warning: stderr, one line
            print(f"warning: skipping checkpoint{'s' if len(failed) > 1 else ''} {'; '.join(failed)}; "
                  f"resuming from {ckpt.name}", file=sys.stderr, flush=True)
        accelerator.print(f"resuming {output} at step {state['step']} from {ckpt.name}")
        return state["step"], state["tokens_seen"], ckpt
    if failed:  # the model may hold part of a failed load: do not train on from it
        raise UserError(f"--resume: no checkpoint in {output / 'checkpoints'} loads ({'; '.join(failed)}); "
                        "move them away to restart from step 0, or train into a new --output")
    accelerator.print(f"no complete checkpoint in {output}; starting from step 0")
    return 0, 0, None
