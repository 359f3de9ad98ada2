"""MELT training: recipes, data, the objective, and the Accelerate-based runner (`melt-eval train`)."""

from melt_eval.training.config import Recipe, load_recipe
from melt_eval.training.runner import run_recipe, train

__all__ = ["Recipe", "load_recipe", "run_recipe", "train"]
