"""Reading JSON and JSON-lines files the user hands the harness: every way a file can be unreadable
(a directory, bytes that are not UTF-8, bad syntax, nesting too deep, a lone surrogate) is a one-line
UserError naming the file (and line), never a traceback."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Iterator

from melt_eval.errors import UserError
from melt_eval.files import MAX_READ_BYTES, check_regular_file, write_text_atomic

MAX_DEPTH = 64  # no harness file nests deeper; far deeper input would hit Python's recursion limit


def read_text(path: str | Path, what: str = "a file", max_bytes: int = MAX_READ_BYTES) -> str:
    """A file's text (UTF-8), or a UserError saying why it cannot be read (not a regular file, over
    `max_bytes`, not UTF-8)."""
    path = Path(path)
    check_regular_file(path, what, max_bytes)
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"{path} is not UTF-8 text (byte {exc.start}); save it as UTF-8") from None
    except OSError as exc:
        raise UserError(f"cannot read {path} ({exc.strerror or type(exc).__name__})") from None


def _depth(obj, limit: int) -> int:
    """Nesting depth of a parsed JSON value, stopping once past `limit` (iterative: no recursion)."""
    deepest, stack = 0, [(obj, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            deepest = max(deepest, depth)
            if deepest > limit:
                return deepest
            stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
    return deepest


def _check_strings(obj, where: str) -> None:
    """Every string encodes as UTF-8 (JSON's \\ud800 escapes decode to lone surrogates that do not)."""
    try:
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = exc.object[exc.start : exc.end].encode("unicode_escape").decode("ascii")
        raise UserError(f"{where} holds a lone surrogate ({bad}), which is not text; fix that string") from None


def parse_json(text: str, where: str, what: str = "JSON"):
    """One JSON value from `text`; `where` names the file (and line) in the error."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(f"{where} is not valid JSON ({exc.msg}); fix or remove it") from None
    except RecursionError:
        raise UserError(f"{where} is nested too deeply to be {what}") from None
    if _depth(obj, MAX_DEPTH) > MAX_DEPTH:
        raise UserError(f"{where} is nested more than {MAX_DEPTH} levels deep; it cannot be {what}")
    _check_strings(obj, where)
    return obj


def finite(obj):
    """`obj` with every float that is not finite (NaN, Infinity) as None: JSON has no such numbers."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def dumps(obj, **kwargs) -> str:
    """Strict JSON for what the harness prints: a number that is not finite is null, never NaN (which no
    JSON reader but Python's accepts)."""
    return json.dumps(finite(obj), allow_nan=False, **kwargs)


def write_json_strict(path: Path, obj) -> None:
    """`files.write_json_atomic` for a file the harness reads back or hands to other tools as JSON: NaN and
    Infinity written as null."""
    write_text_atomic(Path(path), dumps(obj, indent=2, default=str) + "\n")


def read_json(path: str | Path, what: str = "a JSON file", max_bytes: int = MAX_READ_BYTES):
    """A whole JSON file's value."""
    return parse_json(read_text(path, what, max_bytes), str(path), what)


def read_json_lines(path: str | Path, what: str = "a JSON-lines file") -> Iterator[tuple[str, dict]]:
    """("file:line", object) for each non-empty line; a line that is not a JSON object is a UserError."""
    for number, line in enumerate(read_text(path, what).splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        row = parse_json(line, where)
        if not isinstance(row, dict):
            raise UserError(f"{where} is not a JSON object (got a {type(row).__name__})")
        yield where, row
