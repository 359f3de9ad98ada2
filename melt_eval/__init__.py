"""melt-eval: the harness for MELT (Memory-Efficient Looped Transformer).

Importing the package is light: it loads neither torch nor transformers, so `melt-eval --help` starts at
once. Its subpackages load on first use, as attributes too (`melt_eval.modeling`); importing
`melt_eval.modeling` registers the "ouro" and "melt" model types with transformers' Auto classes.
"""

from __future__ import annotations

import importlib
import importlib.util

__version__ = "0.1.0"


def __getattr__(name: str):
    """`melt_eval.<subpackage>` without importing it first: imported here, on first use."""
    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
