"""A rich progress bar for one task: problems done, tokens generated, ETA."""

from __future__ import annotations

from contextlib import contextmanager

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


@contextmanager
def task_progress(title: str, problems: int, samples: int, enabled: bool = True):
    """Yields `on_batch(problems_finished, tokens_generated)`."""
    if not enabled:
        yield lambda done, tokens: None
        return
    columns = [TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("problems x{task.fields[samples]}  {task.fields[tokens]} tok"),
               TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn()]
    with Progress(*columns, transient=False) as bar:
        task = bar.add_task(title, total=problems, samples=samples, tokens=0)
        tokens = 0

        def on_batch(done: int, new_tokens: int) -> None:
            nonlocal tokens
            tokens += new_tokens
            bar.update(task, advance=done, tokens=tokens)

        yield on_batch
