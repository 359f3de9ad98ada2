"""Byte sizes as people write and read them: `512MiB`, `40GB` in, `1.5 GiB` out.

A neutral helper: it imports nothing from the harness but `melt_eval.errors`, so the command line
(`--max-cache-bytes`, `--kv-cache-bytes`) and the engine (its refusals) share it without either importing
the other.
"""

from __future__ import annotations

import math

from melt_eval.errors import UserError


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"


def parse_bytes(text: str | int, flag: str = "--max-cache-bytes") -> int:
    """A byte-size option (`flag`): a byte count, optionally with a unit (`512MiB`, `40GB`, `1.5GiB`)."""
    units = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
             "k": 2**10, "kib": 2**10, "m": 2**20, "mib": 2**20, "g": 2**30, "gib": 2**30, "tib": 2**40}
    raw = str(text).strip().lower().replace("_", "")
    number = raw.rstrip("abcdefghijklmnopqrstuvwxyz ")
    unit = raw[len(number):].strip()
    try:
        value = float(number) * units[unit]
    except (ValueError, KeyError):
        raise UserError(f"{flag} {text!r} is not a size; give bytes, optionally with a unit (512MiB, 40GB)") from None
    if not math.isfinite(value) or value < 1:
        raise UserError(f"{flag} must be a positive size, got {text!r}")
    return int(value)


def byte_size(flag: str):
    """A command-line parser for the byte-size option `flag` (typer's `parser=`): `parse_bytes` with the flag's
    name in its one-line error (a UserError, which `melt_eval.cli.main` prints as one line, exit 2)."""

    def parse(text: str | int) -> int:
        return parse_bytes(text, flag)

    parse.__name__ = "SIZE"
    return parse
