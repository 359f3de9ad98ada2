"""Load any model the harness knows: registry names, Ouro/MELT checkpoint dirs, HF causal LMs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from melt_eval.errors import UserError
from melt_eval.jsonio import read_json
from melt_eval.modeling.looplm import LoopLMForCausalLM
from melt_eval.modeling.melt import MeltForCausalLM
from melt_eval.modeling.quiet import quiet_transformers
from melt_eval.modeling.tiny import build_tiny_model
from melt_eval.registry import MODELS, cache_home, get_spec


LOOPED_TYPES = ("ouro", "melt")
# The class each looped model_type loads into, and the `architectures` names that belong to it:
# a checkpoint whose config says one thing and whose architecture another is refused.
ARCHITECTURES = {"LoopLMForCausalLM": "ouro", "OuroForCausalLM": "ouro", "MeltForCausalLM": "melt"}
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64", "F8_E4M3", "F8_E5M2")
# Config fields a looped checkpoint needs as whole numbers >= 1 (loops included: T = 0 runs nothing).
LOOPED_INT_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "total_ut_steps", "max_position_embeddings")
LOOPED_OPTIONAL_INT_FIELDS = ("num_key_value_heads", "head_dim")


def read_config(model_dir: Path) -> dict:
    """config.json as a dict, checked: an object with a string model_type (and, for looped models, the
    numbers their classes need); else a one-line UserError naming the file."""
    config_file = Path(model_dir) / "config.json"
    if not config_file.exists():
        raise UserError(f"{model_dir} has no config.json; pass a Hugging Face checkpoint directory")
    config = read_json(config_file, "a model config (config.json)")
    if not isinstance(config, dict):
        raise UserError(f"{config_file} must be a JSON object of config fields, got a {type(config).__name__}")
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise UserError(f"{config_file} has no model_type; a checkpoint's config names its architecture "
                        "(\"ouro\", \"melt\", \"llama\", ...)")
    architectures = config.get("architectures")
    for arch in architectures if isinstance(architectures, list) else []:
        if arch in ARCHITECTURES and ARCHITECTURES[arch] != model_type:
            raise UserError(f"{config_file}: model_type {model_type!r} does not match its architecture {arch} "
                            f"(model_type {ARCHITECTURES[arch]!r}); fix the config")
    if model_type in LOOPED_TYPES:
        for name in LOOPED_INT_FIELDS + LOOPED_OPTIONAL_INT_FIELDS:
            if name not in config or (config[name] is None and name in LOOPED_OPTIONAL_INT_FIELDS):
                continue
            value = config[name]
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UserError(f"{config_file}: {name} must be a whole number >= 1, got {value!r}")
    return config


def checkpoint_model_type(model_dir: Path) -> str:
    return read_config(model_dir)["model_type"]


def check_safetensors(path: Path) -> dict[str, tuple[str, list[int]]]:
    """{tensor name: (dtype, shape)} from a safetensors file's header, after checking that the file is
    whole: a readable header and every tensor's bytes inside the file (nothing is loaded)."""
    path = Path(path)
    size = path.stat().st_size

    def bad(why: str):
        raise UserError(f"{path} is not a valid safetensors file ({why}); re-download or re-save the checkpoint")

    if size < 8:
        bad(f"{size} bytes")
    with open(path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        if header_len > size - 8 or header_len > 100 * 2**20:
            bad(f"header of {header_len} bytes in a {size}-byte file")
        raw = f.read(header_len)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        bad("unreadable header")
    if not isinstance(header, dict):
        bad("header is not a JSON object")
    tensors, end = {}, 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (start, stop) = info["dtype"], info["shape"], info["data_offsets"]
            assert isinstance(dtype, str) and all(isinstance(d, int) and d >= 0 for d in shape) and 0 <= start <= stop
        except (KeyError, TypeError, ValueError, AssertionError):
            bad(f"entry {name!r} has no valid dtype/shape/data_offsets")
        tensors[name] = (dtype, list(shape))
        end = max(end, stop)
    if 8 + header_len + end != size:
        bad(f"the tensors need {8 + header_len + end} bytes, the file has {size}: truncated or padded")
    return tensors


def check_weights(model_dir: Path) -> dict[str, tuple[str, list[int]]]:
    """Every *.safetensors file of the checkpoint, whole and floating-point; {name: (dtype, shape)}."""
    tensors = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        for name, (dtype, shape) in check_safetensors(path).items():
            if dtype not in FLOAT_DTYPES:
                raise UserError(f"{path}: tensor {name} is {dtype}, not a floating-point type; "
                                "the harness loads floating-point checkpoints only")
            tensors[name] = (dtype, shape)
    return tensors


def _names(keys, limit: int = 8) -> str:
    keys = sorted(keys)
    return ", ".join(keys[:limit]) + (f" ... ({len(keys)} in all)" if len(keys) > limit else "")


def _check_loading_info(model_dir: Path, model, info: dict) -> None:
    """Config and weights agree: nothing missing, nothing left unused, every shape right."""
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    missing = [k for k in info.get("missing_keys", []) if not (k == "lm_head.weight" and tied)]
    unused = list(info.get("unexpected_keys", []))
    mismatched = [m[0] if isinstance(m, tuple) else m for m in info.get("mismatched_keys", [])]
    parts = []
    if missing:
        parts.append(f"missing tensors: {_names(missing)}")
    if unused:
        parts.append(f"tensors the config has no place for: {_names(unused)}")
    if mismatched:
        parts.append(f"shape mismatches: {_names(mismatched)}")
    if parts:
        raise UserError(f"checkpoint {model_dir} does not match its config.json ({'; '.join(parts)}); "
                        "check num_hidden_layers, sizes and model_type")


def _load_errors() -> tuple:
    """What from_pretrained raises for a checkpoint it cannot read (hub's strict config dataclasses included)."""
    errors = (OSError, RuntimeError, ValueError, TypeError, KeyError, AttributeError)
    try:
        from huggingface_hub.errors import StrictDataclassError

        return errors + (StrictDataclassError,)
    except ImportError:
        return errors


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def load_looped(model_dir: Path, dtype=torch.float32, device="cpu"):
    """Load an "ouro" or "melt" checkpoint strictly: every tensor present and used, every shape right."""
    cls = MeltForCausalLM if checkpoint_model_type(model_dir) == "melt" else LoopLMForCausalLM
    if not any(Path(model_dir).glob("*.safetensors")):
        raise UserError(f"{model_dir} has no *.safetensors weights; pass a complete checkpoint directory")
    check_weights(model_dir)
    try:
        with quiet_transformers():
            # mismatched shapes are collected (and reported below by name) instead of raised
            model, info = cls.from_pretrained(model_dir, dtype=dtype, output_loading_info=True, ignore_mismatched_sizes=True)
    except _load_errors() as exc:
        raise UserError(f"cannot load {model_dir}: {_first_line(exc)}") from None
    _check_loading_info(model_dir, model, info)
    return model.to(device).eval()


def load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as exc:  # tokenizers and transformers raise many types for a broken file
        files = sorted(p.name for p in Path(model_dir).iterdir() if p.name.startswith(("tokenizer", "vocab", "merges",
                                                                                         "special_tokens")))
        raise UserError(f"cannot load the tokenizer of {model_dir} ({', '.join(files) or 'no tokenizer files'}): "
                        f"{_first_line(exc)}; fix or re-download those files") from None


def resolve_model_dir(name_or_path: str) -> Path:
    """Return a local checkpoint directory for a registry name or a path."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    if name_or_path not in MODELS and ("/" in name_or_path or name_or_path.startswith(".")):
        raise UserError(f"checkpoint directory {name_or_path!r} does not exist; pass an existing directory or a model name")
    spec = get_spec(name_or_path)
    if spec.tiny:
        return build_tiny_model(spec.name, cache_home() / "models")
    if spec.name == "melt-1.6b":
        env = os.environ.get("MELT_EVAL_MELT_1_6B")
        if env and Path(env).is_dir():
            return Path(env)
        raise UserError(
            "melt-1.6b is not released: train it with `melt-eval train --recipe paper-phase1 --from "
            "ouro-1.4b-thinking ...` (then paper-phase2) and pass the output directory, or set MELT_EVAL_MELT_1_6B"
        )
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(spec.hub_id, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"]))
    except Exception as exc:  # offline, gated, or missing
        raise UserError(
            f"could not fetch {spec.hub_id} from the Hugging Face Hub ({type(exc).__name__}); "
            "download it where the Hub is reachable and pass its directory instead"
        ) from None


def load_model(name_or_path: str | Path, dtype=torch.float32, device="cpu"):
    """(model, tokenizer) for a registry name or a checkpoint directory; the checkpoint is checked first
    (config.json, every weights file, config and weights agreeing), so a broken one is a UserError."""
    model_dir = resolve_model_dir(str(name_or_path))
    if checkpoint_model_type(model_dir) in LOOPED_TYPES:
        model = load_looped(model_dir, dtype=dtype, device=device)
    else:
        from transformers import AutoModelForCausalLM

        check_weights(model_dir)
        try:
            with quiet_transformers():
                model, info = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, output_loading_info=True)
        except _load_errors() as exc:
            raise UserError(f"cannot load {model_dir}: {_first_line(exc)}") from None
        _check_loading_info(model_dir, model, info)
        model = model.to(device).eval()
    return model, load_tokenizer(model_dir)
