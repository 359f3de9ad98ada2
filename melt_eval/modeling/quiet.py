"""Quiet transformers while the harness saves or loads weights: it shows its own progress."""

from __future__ import annotations

import contextlib

from transformers.utils import logging as hf_logging


@contextlib.contextmanager
def quiet_transformers():
    """Hide transformers' per-shard progress bars for the duration of the block."""
    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()
