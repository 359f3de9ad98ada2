"""Progress of long stages (training steps, problems evaluated): a rich bar on a terminal, plain lines elsewhere.

A rich bar only draws on a terminal; in a CI log or `melt-eval demo > demo.log` it would print nothing
for many minutes. There, `PlainProgress` prints one line per stage at a fixed cadence instead:

    [looplm] step 120/600  elapsed 1m02s  ETA 4m08s  loss 1.234

Both take the same calls (`add_task`, `update`, `with`), so the training runner and the evaluation use
either without knowing which. The cadence is MELT_EVAL_PROGRESS_EVERY seconds (default 30).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from contextlib import contextmanager

DEFAULT_EVERY_S = 30.0


PLAIN_ENV = "MELT_EVAL_PLAIN_PROGRESS"  # set (to 1): lines even on a terminal, as processes sharing one must


def interactive() -> bool:
    """Both streams on a terminal: a bar can redraw in place. Otherwise (a log, a pipe) lines are printed."""
    return not os.environ.get(PLAIN_ENV) and sys.stdout.isatty() and sys.stderr.isatty()


def cadence_s() -> float:
    try:
        return max(0.0, float(os.environ.get("MELT_EVAL_PROGRESS_EVERY", DEFAULT_EVERY_S)))
    except ValueError:
        return DEFAULT_EVERY_S


def clock(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


class PlainProgress:
    """The subset of rich.progress.Progress the harness uses, as a plain line every `every` seconds per
    task (and when a task finishes). `unit` names what is counted ("step", "problems"); `line` formats
    a task's extra fields (e.g. the loss) for the end of the line."""

    def __init__(self, unit: str, line=None, every: float | None = None, enabled: bool = True, stream=None):
        self.unit, self.line, self.enabled = unit, line, enabled
        self.every = cadence_s() if every is None else every
        self.stream = stream
        self.tasks: dict[int, dict] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None

    def __enter__(self):
        # a clock of its own: one generation batch can outlast the cadence, and the log must still move
        if self.enabled and self.every > 0:
            self._ticker = threading.Thread(target=self._tick, daemon=True)
            self._ticker.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()

    def _tick(self) -> None:
        while not self._stop.wait(min(self.every, 5.0)):
            now = time.monotonic()
            with self._lock:
                for t in self.tasks.values():
                    if not t.get("finished") and now - t["printed"] >= self.every:
                        t["printed"] = now
                        self._print(t, now)

    def add_task(self, description: str, total: int, completed: int = 0, **fields) -> int:
        now = time.monotonic()
        task_id = len(self.tasks)
        self.tasks[task_id] = dict(description=description, total=total, completed=completed, start=now,
                                   start_completed=completed, printed=now, fields=fields)
        if self.enabled:  # a first line at once: the log shows the stage has started
            self._print(self.tasks[task_id], now)
        return task_id

    def update(self, task_id: int, *, completed: int | None = None, advance: int | None = None, **fields) -> None:
        t = self.tasks[task_id]
        if completed is not None:
            t["completed"] = completed
        if advance:
            t["completed"] += advance
        t["fields"].update(fields)
        now = time.monotonic()
        done = t["completed"] >= t["total"]
        with self._lock:
            if self.enabled and (now - t["printed"] >= self.every or (done and not t.get("finished"))):
                t["printed"], t["finished"] = now, done
                self._print(t, now)

    def _print(self, t: dict, now: float) -> None:
        elapsed = now - t["start"]
        made = t["completed"] - t["start_completed"]
        left = t["total"] - t["completed"]
        eta = clock(elapsed / made * left) if made > 0 else "?"
        text = f"[{t['description']}] {self.unit} {t['completed']}/{t['total']}  elapsed {clock(elapsed)}  ETA {eta}"
        extra = self.line(t["fields"]) if self.line else ""
        print(text + (f"  {extra}" if extra else ""), file=self.stream or sys.stdout, flush=True)


def progress_display(unit: str, enabled: bool = True, line=None, rich_columns=()):
    """A rich bar on a terminal, else `PlainProgress` lines; `rich_columns` are the bar's extra columns."""
    if not interactive():
        return PlainProgress(unit, line=line, enabled=enabled)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), *rich_columns,
                    TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), disable=not enabled)


def training_progress(enabled: bool = True):
    """Training steps: the step counter, then the runner's status text (loss, ...)."""
    from rich.progress import TextColumn

    return progress_display("step", enabled, line=lambda f: f.get("status", ""),
                            rich_columns=(TextColumn("{task.fields[status]}"),))


@contextmanager
def task_progress(title: str, problems: int, samples: int, enabled: bool = True, done: int = 0):
    """Yields `on_batch(problems_finished, tokens_generated)`; `done`: problems an earlier, interrupted run
    finished (the count starts there, and the ETA counts only what this run does)."""
    if not enabled:
        yield lambda done, tokens: None
        return
    from rich.progress import TextColumn

    bar = progress_display("problems", line=lambda f: f"x{f['samples']} samples  {f['tokens']:,} tokens generated",
                           rich_columns=(TextColumn("problems x{task.fields[samples]}  {task.fields[tokens]} tok"),))
    with bar:
        task = bar.add_task(title, total=problems, completed=done, samples=samples, tokens=0)
        tokens = 0

        def on_batch(done: int, new_tokens: int) -> None:
            nonlocal tokens
            tokens += new_tokens
            bar.update(task, advance=done, tokens=tokens)

        yield on_batch
