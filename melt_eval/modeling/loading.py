"""Load any model the harness knows: registry names, Ouro/MELT checkpoint dirs, HF causal LMs."""

from __future__ import annotations

import json
from pathlib import Path

import contextlib

import torch
from transformers.utils import logging as hf_logging

from melt_eval.errors import UserError


@contextlib.contextmanager
def quiet_transformers():
    """Hide transformers' per-shard progress bars: the harness shows its own progress."""
    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def checkpoint_model_type(model_dir: Path) -> str:
    config_file = Path(model_dir) / "config.json"
    if not config_file.is_file():
        raise UserError(f"{model_dir} has no config.json; pass a Hugging Face checkpoint directory")
    try:
        return json.loads(config_file.read_text()).get("model_type", "")
    except json.JSONDecodeError as exc:
        raise UserError(f"{config_file} is not valid JSON ({exc}); fix or re-download the checkpoint") from None


def load_looped(model_dir: Path, dtype=torch.float32, device="cpu"):
    """Load an "ouro" or "melt" checkpoint strictly: every tensor present, every shape right."""
    from melt_eval.modeling import LoopLMForCausalLM, MeltForCausalLM

    cls = MeltForCausalLM if checkpoint_model_type(model_dir) == "melt" else LoopLMForCausalLM
    if not any(Path(model_dir).glob("*.safetensors")):
        raise UserError(f"{model_dir} has no *.safetensors weights; pass a complete checkpoint directory")
    try:
        with quiet_transformers():
            # mismatched shapes are collected (and reported below by name) instead of raised
            model, info = cls.from_pretrained(model_dir, dtype=dtype, output_loading_info=True, ignore_mismatched_sizes=True)
    except (OSError, RuntimeError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"cannot load {model_dir}: {first}") from None
    missing = [k for k in info.get("missing_keys", []) if not (k == "lm_head.weight" and model.config.tie_word_embeddings)]
    mismatched = sorted(m[0] if isinstance(m, tuple) else m for m in info.get("mismatched_keys", []))
    if missing or mismatched:
        parts = []
        if missing:
            parts.append(f"missing tensors: {', '.join(sorted(missing)[:8])}{' ...' if len(missing) > 8 else ''}")
        if mismatched:
            parts.append(f"shape mismatches: {', '.join(mismatched[:8])}{' ...' if len(mismatched) > 8 else ''}")
        raise UserError(f"checkpoint {model_dir} does not match its config ({'; '.join(parts)})")
    return model.to(device).eval()


def load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def load_model(name_or_path: str | Path, dtype=torch.float32, device="cpu"):
    """(model, tokenizer) for a registry name or a checkpoint directory."""
    from melt_eval.registry import resolve_model_dir

    model_dir = resolve_model_dir(str(name_or_path))
    if checkpoint_model_type(model_dir) in ("ouro", "melt"):
        model = load_looped(model_dir, dtype=dtype, device=device)
    else:
        from transformers import AutoModelForCausalLM

        with quiet_transformers():
            model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()
    return model, load_tokenizer(model_dir)
