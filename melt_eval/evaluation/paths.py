"""`--name` checked without loading anything (no torch, no LightEval): `run` refuses a bad one in a second."""

from __future__ import annotations

from melt_eval.errors import UserError


def check_name(name: str | None) -> None:
    """Results stay under --output: a name is one plain, printable directory name."""
    if name is None:
        return
    if not name.strip() or name.strip() in (".", "..") or any(sep in name for sep in ("/", "\\", "\0")):
        raise UserError(f"--name {name!r} must be a plain directory name (no '/', '..' or '.'), "
                        "so that the results stay under --output")
    if not name.isprintable() or len(name.encode()) > 255:  # a newline splits the table's row; 255: a file name
        raise UserError(f"--name {name[:40]!r}{'...' if len(name) > 40 else ''} must be printable and at most 255 "
                        "bytes (one directory name); pass a shorter, plain one")
