"""Per-step metrics (logs/metrics.jsonl, TensorBoard) and the progress line.

A resumed run redoes the steps after its checkpoint, so the log is cut back to that step first:
metrics.jsonl then holds each step once, as if the run had never stopped, and readers
(runs.py, the report) can trust it without knowing about interruptions.
"""

from __future__ import annotations

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


class Logger:
    """Per-step metrics to JSONL and TensorBoard (main process only)."""

    def __init__(self, output: Path, enabled: bool, tensorboard: bool, resume_step: int) -> None:
        self.enabled = enabled
        self.path = output / "logs" / "metrics.jsonl"
        self.tb = None
        self.note = None  # set before the early return: every process's caller reads it
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
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


def status(record: dict) -> str:
    """The progress line's status for one step's record."""
    bits = [f"loss {record['loss']:.4f}"]
    for k in ("kd", "sft", "align"):
        if k in record:
            bits.append(f"{k} {record[k]:.4f}")
    bits.append(f"α {record['alpha']:.2f}")
    if "gate_mean_all" in record:
        bits.append(f"z̄ {record['gate_mean_all']:.3f}")
    bits.append(f"{record['tokens_per_s']:.0f} tok/s")
    return " · ".join(bits)


def progress_bar(enabled: bool):
    from melt_eval.progress import training_progress

    return training_progress(enabled)  # a bar on a terminal, plain lines at a fixed cadence in a log
