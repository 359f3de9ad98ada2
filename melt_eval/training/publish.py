"""The end of a finished run: a model card (DIR/README.md) and, with `--push-to-hub`, an upload to the Hub.

Main process only. A failed push (no network, no token, HF_HUB_OFFLINE) is one UserError line naming
the repo: the run is finished and its model stays in the output directory.
"""

from __future__ import annotations

from pathlib import Path

from melt_eval.errors import UserError
from melt_eval.files import write_text_atomic

CITATION = """@misc{melt,
  title  = {Memory-Efficient Looped Transformer: Decoupling Compute from Memory in Looped Language Models},
  author = {Conchello Vendrell, Victor and Padr{\\'e}s Masdemont, Arnau and Grillo, Niccol{\\`o} and
            Ros-Giralt, Jordi and Behboodi, Arash and Massoli, Fabio Valerio},
  note   = {Qualcomm AI Research},
}"""


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("melt-eval")
    except Exception:  # a source checkout that was not installed
        return "unknown"


def model_card(meta: dict, hub_model_id: str | None = None) -> str:
    """README.md for a finished run from its META_FILE record (melt_eval_training.json)."""
    recipe = meta.get("recipe") or {}
    code = meta.get("code") or {}
    target = meta.get("target", "melt")
    rows = [("base model", meta.get("from_model")), ("teacher", meta.get("teacher")),
            ("recipe", recipe.get("name") or meta.get("recipe_name")), ("target", target), ("phase", meta.get("phase")),
            ("steps", meta.get("steps")), ("tokens seen", meta.get("tokens_seen")),
            ("gate", recipe.get("gate")), ("chunk size", recipe.get("chunk_size")),
            ("early-exit gate", meta.get("exit_gate")),  # "fitted" by the exit-gate recipe
            ("melt-eval", f"{_version()} (git {code.get('git_sha') or 'unknown'})")]
    table = "\n".join(f"| {k} | {v} |" for k, v in rows if v is not None)
    base = meta.get("from_model")
    front = ["---", "library_name: transformers", "tags:", "- melt", "- looped-transformer", "- melt-eval"]
    if base and not Path(str(base)).exists():  # a Hub id, not a local path
        front.append(f"base_model: {base}")
    front.append("---")
    title = hub_model_id or "MELT model"
    return "\n".join([*front, "", f"# {title}", "",
                      f"{target.upper() if target == 'melt' else target} model trained with `melt-eval train` "
                      "(melt_eval/training/). The full recipe is in `recipe.yaml`, the run's record in "
                      "`melt_eval_training.json`, per-step metrics in `logs/metrics.jsonl`.", "",
                      "| | |", "| --- | --- |", table, "", "## Citation", "", "```bibtex", CITATION, "```", ""])


def write_model_card(output: Path, meta: dict, hub_model_id: str | None = None) -> Path:
    path = output / "README.md"
    write_text_atomic(path, model_card(meta, hub_model_id))
    return path


def push_to_hub(output: Path, repo_id: str | None = None, private: bool | None = None) -> str:
    """Upload the run directory (model, tokenizer, card, recipe, logs; not checkpoints) to the Hub; returns its URL."""
    repo_id = repo_id or output.name
    try:
        from huggingface_hub import HfApi

        api = HfApi()
        url = api.create_repo(repo_id, private=private, exist_ok=True)
        repo_id = getattr(url, "repo_id", None) or repo_id
        api.upload_folder(repo_id=repo_id, folder_path=str(output), commit_message="melt-eval train",
                          ignore_patterns=["checkpoints/*", ".melt-eval.lock", "*.tmp*"])
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise UserError(f"--push-to-hub: could not push to {repo_id} ({type(exc).__name__}: {first}); "
                        f"the model is saved locally in {output}") from None
    return f"https://huggingface.co/{repo_id}"
