"""A training run directory seen from outside (`ablate`, the demo): its state, and the command that makes it.

What marks a run finished or interrupted is the runner's business (run_files.py: its meta file, its
recipe.yaml); callers ask here instead of reading those files.
"""

from __future__ import annotations

from pathlib import Path

from melt_eval.training.metrics import read_metrics
from melt_eval.training.run_files import read_meta

FINISHED, INTERRUPTED, NOT_STARTED = "finished", "interrupted", "not started"


def run_state(run_dir: Path) -> str:
    """FINISHED, INTERRUPTED (`--resume` continues it) or NOT_STARTED."""
    meta = read_meta(run_dir)  # an unreadable meta file is not "finished": --resume recovers it
    if isinstance(meta, dict) and meta.get("status") == "finished":
        return FINISHED
    return INTERRUPTED if (run_dir / "recipe.yaml").exists() else NOT_STARTED


def final_gate_means(run_dir: Path) -> list[float] | None:
    """The MELT gate's mean z_t at loops t = 2..T at the end of a run, averaged over layers, from the last
    training record that logged it (a mean over that step's chunks, padded rows included); None where
    no gate was logged (a LoopLM run, or no log). The mean gate reads (t - 1) / t, `last` 0."""
    log = run_dir / "logs" / "metrics.jsonl"
    if not log.exists():
        return None
    for _, record in reversed(read_metrics(log)[0]):
        by_layer = record.get("gate_mean")
        if by_layer:
            loops = zip(*by_layer.values())  # per loop, one value per layer (None at loop 1)
            return [round(sum(v) / len(v), 4) for v in loops if None not in v]
    return None


def step_seconds(run_dir: Path) -> float | None:
    """Seconds the run's optimizer steps took, summed from its log (`step_time_s`): its training work, without
    start-up, held-out checks or saving; None where there is no log."""
    log = run_dir / "logs" / "metrics.jsonl"
    if not log.exists():
        return None
    return round(sum(record.get("step_time_s") or 0.0 for _, record in read_metrics(log)[0]), 1)


# Recipe keys with a switch of their own on `melt-eval train` (training/cli.py); any other key is --set.
_SWITCHES = {"gate": "--gate", "interpolation_steps": "--interpolation-steps", "chunk_size": "--chunk-size"}


# Multi-GPU launch with the FSDP config shipped beside the recipes (what the paper-sized runs need).
FSDP_LAUNCH = "accelerate launch --config_file melt_eval/recipes/accelerate/fsdp.yaml -m melt_eval.cli train"


def train_command(recipe: str, from_model: str | Path, output: Path, overrides: dict, *, fsdp: bool = False) -> str:
    """The `melt-eval train` command line that runs `recipe` with `overrides` (what `ablate --dry-run` prints);
    fsdp: the `accelerate launch` form with melt_eval/recipes/accelerate/fsdp.yaml instead."""
    flags = []
    for key, value in sorted(overrides.items()):
        if key == "kd":
            flags.append("--kd" if value else "--no-kd")
        elif key in _SWITCHES:
            flags.append(f"{_SWITCHES[key]} {value}")
        else:
            flags.append(f"--set {key}={value}")
    launcher = FSDP_LAUNCH if fsdp else "melt-eval train"
    return " ".join([f"{launcher} --recipe {recipe} --from {from_model} --output {output}", *flags])
