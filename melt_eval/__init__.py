"""melt-eval: the harness for MELT (Memory-Efficient Looped Transformer).

Importing the package registers the "ouro" and "melt" model types with transformers.
"""

__version__ = "0.1.0"

from melt_eval import modeling  # noqa: E402,F401  (registers the Auto classes)
