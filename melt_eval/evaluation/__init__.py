"""Evaluation: LightEval tasks, the harness's LightevalModel, `run`, `score` and `tasks`."""

from melt_eval.evaluation.runner import BackendSettings, RunPaths, run_tasks, score_completions

__all__ = ["BackendSettings", "RunPaths", "run_tasks", "score_completions"]
