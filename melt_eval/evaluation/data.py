"""Benchmark rows from a `--data-dir` file, the built-in generator or the Hub; completions files."""

from __future__ import annotations

from pathlib import Path

from melt_eval.errors import UserError
from melt_eval.files import check_regular_file
from melt_eval.jsonio import read_json_lines
from melt_eval.evaluation.tasks import MMLU_REDUX_SUBJECTS, SYNTHETIC_TESTS, TaskSpec, row_id
from melt_eval import synthetic


SCHEMA_MATH = '{"problem", "answer"}'
LOCAL_SCHEMA = {  # what a --data-dir file needs per task kind (the Hub dataset's own fields also work)
    "math": SCHEMA_MATH,
    "choice": '{"question", "choices", "answer"} (MMLU-Redux) or GPQA\'s "Question", "Correct Answer", "Incorrect Answer 1-3"',
    "code": '{"task_id", "prompt", "test", "entry_point"}',
    "judge-free": '{"id", "question", "answer", "answer_type", "image"}',
}


def check_data_dir(specs: list[TaskSpec], data_dir: str | Path | None) -> None:
    """--data-dir checked before any row, dataset or model is loaded: a directory holding each task's file
    (tasks with a built-in generator need none)."""
    if data_dir is None:
        return
    path = Path(data_dir)
    if not path.exists():
        raise UserError(f"--data-dir {data_dir} does not exist; pass the directory holding <task>.jsonl files")
    if not path.is_dir():
        raise UserError(f"--data-dir {data_dir} is a file, not a directory; pass the directory holding <task>.jsonl files")
    for spec in specs:
        if spec.hf_repo is not None:
            _local_file(spec, path)


def check_completions_file(path: str | Path) -> None:
    """--completions checked before any row or dataset is loaded: a file that exists."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"completions file {path} does not exist")
    if path.is_dir():
        raise UserError(f"--completions {path} is a directory; pass a JSONL file")
    check_regular_file(path, "a JSONL file for --completions")  # a FIFO or /dev/zero would hang or fill memory


def load_rows(spec: TaskSpec, data_dir: str | Path | None, max_problems: int | None) -> list[dict]:
    """The evaluation split's rows, in order, each with its position as `_position` (LightEval owns `__index`)."""
    if spec.hf_repo is None:
        rows = synthetic.make_split("test", **SYNTHETIC_TESTS[spec.name])
    elif data_dir is not None:
        rows = _read_local(spec, Path(data_dir))
    else:
        rows = _read_hub(spec)
    if spec.select is not None:
        rows = spec.select(rows)
    if not rows:
        raise UserError(f"{spec.name}: the data has no rows")
    rows = rows[:max_problems] if max_problems else rows
    check = spec.prompt
    for i, row in enumerate(rows):
        row["_position"] = i
        try:
            check(row, spec.name)
        except (KeyError, TypeError, ValueError) as exc:
            raise UserError(f"{spec.name}: row {i} does not fit the task's schema ({type(exc).__name__}: {exc}); "
                            f"use the Hub dataset's fields or {LOCAL_SCHEMA.get(spec.kind, SCHEMA_MATH)}") from None
    return rows


def _local_file(spec: TaskSpec, data_dir: Path) -> Path:
    for suffix in (".jsonl", ".json", ".parquet"):
        path = data_dir / f"{spec.name}{suffix}"
        if path.is_dir():
            raise UserError(f"{path} is a directory; --data-dir needs the file {spec.name}.jsonl or {spec.name}.parquet")
        if path.exists() or path.is_symlink():
            break
    else:
        raise UserError(f"no {spec.name}.jsonl or {spec.name}.parquet in {data_dir}; add it or drop --data-dir to use the Hub")
    check_regular_file(path, f"a {spec.name} data file for --data-dir")  # a FIFO, a device or a huge file: refused unread
    return path


def _read_local(spec: TaskSpec, data_dir: Path) -> list[dict]:
    path = _local_file(spec, data_dir)
    if path.suffix == ".parquet":
        import pandas as pd

        try:
            return pd.read_parquet(path).to_dict("records")
        except Exception as exc:  # pyarrow raises several types for a bad file
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise UserError(f"{path} is not a readable parquet file ({first})") from None
    return [row for _, row in read_json_lines(path)]


def _read_hub(spec: TaskSpec) -> list[dict]:
    from datasets import load_dataset

    # MMLU-Redux is one Hub config per subject; the task is all of them, subject recorded on each row
    subsets = MMLU_REDUX_SUBJECTS if spec.hf_subset == "*" else [spec.hf_subset]
    rows = []
    for subset in subsets:
        try:
            ds = load_dataset(spec.hf_repo, subset if subset != "default" else None, split=spec.split)
        except Exception as exc:  # offline, gated or renamed datasets all land here
            raise UserError(
                f"cannot load {spec.name} from the Hub ({spec.hf_repo}: {type(exc).__name__}); "
                f"pass --data-dir DIR with {spec.name}.jsonl ({LOCAL_SCHEMA.get(spec.kind, SCHEMA_MATH)} per line) "
                "to run offline"
            ) from None
        rows += [dict(r, subject=subset) if spec.hf_subset == "*" else dict(r) for r in ds]
    return rows


def read_completions(path: Path, rows: list[dict]) -> dict[int, list[str]]:
    """{position in the split: completions} from `{"index"|"id": ..., "completions": [...]}` lines."""
    check_completions_file(path)
    ids = {str(row_id(r)): i for i, r in enumerate(rows) if row_id(r) is not None}
    out: dict[int, list[str]] = {}
    for where, row in read_json_lines(path):
        if "index" in row:
            position = row["index"]
            if type(position) is not int or not 0 <= position < len(rows):  # true is not problem 1
                raise UserError(f"{where}: index {position!r} names no problem (the split has {len(rows)}, from 0)")
        elif "id" in row:
            if str(row["id"]) not in ids:
                raise UserError(f"{where}: id {row['id']!r} names no problem of the task")
            position = ids[str(row["id"])]
        else:
            raise UserError(f"{where} names no problem: give \"index\" (position in the split) or \"id\"")
        completions = row.get("completions")
        if isinstance(completions, list):  # a run's details.jsonl holds {"text", "extracted", "correct"} per sample
            completions = [c["text"] if isinstance(c, dict) and isinstance(c.get("text"), str) else c for c in completions]
        if not isinstance(completions, list) or not completions or not all(isinstance(c, str) for c in completions):
            raise UserError(f"{where}: \"completions\" must be a non-empty list of strings")
        if out and len(completions) != len(next(iter(out.values()))):
            raise UserError(f"{where}: {len(completions)} completions where earlier lines have "
                            f"{len(next(iter(out.values())))}; give every problem the same number")
        if position in out:
            raise UserError(f"{where}: problem {position} appears twice")
        out[position] = completions
    if not out:
        raise UserError(f"{path} holds no completions")
    return out
