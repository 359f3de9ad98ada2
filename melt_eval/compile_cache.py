"""Where torch.compile's Inductor keeps its cache: under the harness's home (MELT_EVAL_HOME), beside the models it
builds, not in /tmp/torchinductor_<user>, so a run writes nothing outside its output directory and that home."""

from __future__ import annotations

import os

from melt_eval.registry import cache_home

VARIABLE = "TORCHINDUCTOR_CACHE_DIR"  # Inductor's own; read when it first compiles, inherited by child processes


def directory() -> str:
    return os.path.abspath(os.path.expanduser(cache_home() / "torchinductor"))


def pin() -> None:
    """Point Inductor at `directory()` unless the user set its variable; before torch compiles anything."""
    os.environ.setdefault(VARIABLE, directory())
