"""Per-step metrics (logs/metrics.jsonl, Accelerate's trackers: TensorBoard, wandb, trackio, mlflow...) and the progress line.

A resumed run redoes the steps after its checkpoint, so the log is cut back to that step first:
metrics.jsonl then holds each step once, as if the run had never stopped, and readers
(runs.py, the report) can trust it without knowing about interruptions.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

from melt_eval.files import write_text_atomic


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


AUTO, NONE, ALL = "auto", "none", "all"


def tracker_names() -> list[str]:
    """The tracker names Accelerate knows (tensorboard, wandb, trackio, mlflow, comet_ml, aim, ...)."""
    from accelerate.tracking import LOGGER_TYPE_TO_CLASS

    return sorted(LOGGER_TYPE_TO_CLASS)


def check_log_with(value: str, bad) -> None:
    names = [n.strip() for n in str(value).split(",") if n.strip()]
    unknown = [n for n in names if n not in (AUTO, NONE, ALL, *tracker_names())]
    if unknown or not names:
        bad(f"log_with: unknown tracker {', '.join(unknown) or repr(value)}; choose from "
            f"{', '.join([AUTO, NONE, ALL, *tracker_names()])} (comma-separated)")


def trackers(log_with: str, tensorboard: bool, output: Path) -> list:
    """What `Accelerator(log_with=...)` gets for a recipe's `log_with` (and the older `tensorboard` key).
    TensorBoard writes to DIR/logs/tb (Logger cuts it back to the resumed step, as metrics.jsonl)."""
    names = [n.strip() for n in str(log_with).split(",") if n.strip()]
    if ALL in names:
        from accelerate.utils import filter_trackers

        names = [str(t) for t in filter_trackers(ALL)]
    has_tb = importlib.util.find_spec("tensorboard") is not None
    if AUTO in names:
        names = [n for n in names if n != AUTO] + (["tensorboard"] if has_tb else [])
    names = list(dict.fromkeys(n for n in names if n != NONE and (tensorboard or n != "tensorboard")))
    out: list = [n for n in names if n != "tensorboard"]
    if "tensorboard" in names:
        from accelerate.tracking import TensorBoardTracker

        out.insert(0, TensorBoardTracker("tb", str(output / "logs")))
    return out


def scalars(record: dict) -> dict:
    """A record's finite numbers as tracker scalars (dots become slashes; gate means per layer and loop)."""
    values = {}
    for key, value in record.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step" and math.isfinite(value):
            values[key.replace(".", "/")] = value
    for name, means in (record.get("gate_mean") or {}).items():
        for t, v in enumerate(means):
            if v is not None:
                values[f"gate/{name}/loop{t + 1}"] = v
    return values


class Logger:
    """Per-step metrics to JSONL (main process only) and to the accelerator's trackers."""

    def __init__(self, output: Path, enabled: bool, resume_step: int, accelerator=None, config: dict | None = None) -> None:
        self.enabled = enabled
        self.path = output / "logs" / "metrics.jsonl"
        self.accelerator = accelerator if accelerator is not None and accelerator.log_with else None
        self.note = None  # set before the early return: every process's caller reads it
        if self.accelerator is not None:  # init_trackers and log run on the main process only
            self.path.parent.mkdir(parents=True, exist_ok=True)
            for tracker in self.accelerator.log_with:  # a resumed run redoes the steps after its checkpoint
                if resume_step and getattr(tracker, "name", None) == "tensorboard":
                    tracker.init_kwargs["purge_step"] = resume_step + 1
            # the recipe as hyperparameters for wandb & co. (TensorBoard alone: recipe.yaml is beside it)
            only_tb = all(getattr(t, "name", t) == "tensorboard" for t in self.accelerator.log_with)
            self.accelerator.init_trackers("melt-eval", config=None if only_tb else _flat(config or {}),
                                           init_kwargs={"wandb": {"name": output.name}})
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():  # drop records of steps the resumed run will redo, and lines cut by an interruption
            records, cut = read_metrics(self.path)
            keep = [line for line, record in records if isinstance(record.get("step"), int) and record["step"] <= resume_step]
            write_text_atomic(self.path, "".join(line + "\n" for line in keep))
            if cut:
                self.note = f"dropped {cut} cut line{'s' if cut > 1 else ''} of {self.path}"

    def log(self, record: dict) -> None:
        if self.enabled:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")
        if self.accelerator is not None:
            self.accelerator.log(scalars(record), step=record["step"])

    def close(self) -> None:
        if self.accelerator is not None:  # not end_training(): it also ends the process group the export still needs
            for tracker in self.accelerator.trackers:
                tracker.finish()


def _flat(config: dict) -> dict:
    """Recipe values trackers accept as hyperparameters (numbers, strings, bools)."""
    return {k: v for k, v in config.items() if isinstance(v, (int, float, str, bool))}


def status(record: dict) -> str:
    """The progress line's status for one step's record."""
    bits = [f"loss {record['loss']:.4f}"]
    for k in ("kd", "sft", "align", "exit_gate"):
        if k in record:
            bits.append(f"{k} {record[k]:.4f}")
    if "exit_lambda" in record:
        bits.append(f"λ̄ {record['exit_lambda']:.3f}")
    bits.append(f"α {record['alpha']:.2f}")
    if "gate_mean_all" in record:
        bits.append(f"z̄ {record['gate_mean_all']:.3f}")
    bits.append(f"{record['tokens_per_s']:.0f} tok/s")
    return " · ".join(bits)


def progress_bar(enabled: bool):
    from melt_eval.progress import training_progress

    return training_progress(enabled)  # a bar on a terminal, plain lines at a fixed cadence in a log
