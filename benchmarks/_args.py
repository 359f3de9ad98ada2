"""Argument types and the parser the benchmark scripts share: a value no run could use is argparse's one-line error (exit 2)
before anything is built, counted or timed, never a traceback at the end of the work (issue 69).

    parser.add_argument("--layers", type=whole(1), default=24)
    parser.add_argument("--json", type=output_file)
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path


class Parser(argparse.ArgumentParser):
    """argparse with its error in one line: argparse prints the usage block above it, a second and third line a
    user must read past; `--help` still prints the usage."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (--help lists the options)\n")


def whole(low: int = 1, high: int | None = None):
    """A whole number from `low` (to `high`)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low or high is not None and value > high:
            span = f"of at least {low}" if high is None else f"from {low} to {high}"
            raise argparse.ArgumentTypeError(f"must be a whole number {span}, got {text!r}")
        return value
    return parse


def number(low: float = -math.inf, high: float = math.inf, above: bool = False):
    """A finite number from `low` (or `above` it) to `high`."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < low or above and value == low or value > high:
            span = (f"above {low:g}" if above else f"from {low:g}" if math.isfinite(low) else "") + \
                (f" to {high:g}" if math.isfinite(high) else "")
            raise argparse.ArgumentTypeError(f"must be a finite number {span}, got {text!r}".replace("  ", " "))
        return value
    return parse


def wholes(low: int = 1, count: int | None = None, distinct: bool = False):
    """Comma-separated whole numbers from `low` (exactly `count` of them; all different)."""
    def parse(text: str) -> tuple[int, ...]:
        values = tuple(whole(low)(x.strip()) for x in text.split(","))
        if count is not None and len(values) != count:
            raise argparse.ArgumentTypeError(f"must be {count} comma-separated whole numbers, got {text!r}")
        if distinct and len(set(values)) < len(values):
            raise argparse.ArgumentTypeError(f"must be different numbers, got {text!r}")
        return values
    return parse


def output_file(text: str) -> Path:
    """A file this process can write (opened for appending, so nothing there is lost; a file made for the check
    is removed): refused now, not after the work it would hold."""
    path = Path(text)
    if not text or path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory or empty; pass a file to write")
    existed = path.exists()
    try:
        with open(path, "a"):
            pass
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot write {text} ({exc.strerror or exc}); pass a writable path") from None
    if not existed:
        path.unlink()
    return path


def device(text: str) -> str:
    """A torch device this machine has: cpu, or cuda[:N] where CUDA is available."""
    import torch

    try:
        kind = torch.device(text).type
    except (RuntimeError, ValueError):
        kind = None
    if kind not in ("cpu", "cuda") or kind == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text!r} is no device here; pass cpu" +
                                         (" or cuda" if torch.cuda.is_available() else " (no CUDA device is visible)"))
    return text


def input_file(text: str) -> Path:
    """A regular file this process can read."""
    path = Path(text)
    try:
        with open(path, "rb"):
            pass
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot read {text} ({exc.strerror or exc})") from None
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{text} is not a file")
    return path
