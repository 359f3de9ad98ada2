"""Load any model the harness knows: registry names, Ouro/MELT checkpoint dirs, HF causal LMs."""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from melt_eval.errors import UserError
from melt_eval.files import check_regular_file, verify_sums
from melt_eval.jsonio import read_json
from melt_eval.modeling.looplm import CHECKPOINT_LAYOUT, LoopLMForCausalLM, checkpoint_names
from melt_eval.modeling.melt import MeltForCausalLM
from melt_eval.modeling.quiet import quiet_transformers
from melt_eval.modeling.tiny import build_tiny_model
from melt_eval.registry import MODELS, ModelSpec, cache_home, get_spec


LOOPED_TYPES = ("ouro", "melt")
# The class each looped model_type loads into, and the `architectures` names that belong to it:
# a checkpoint whose config says one thing and whose architecture another is refused.
ARCHITECTURES = {"LoopLMForCausalLM": "ouro", "OuroForCausalLM": "ouro", "MeltForCausalLM": "melt"}
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64", "F8_E4M3", "F8_E5M2")
DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
               "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1}
# Config numbers that must be finite and > 0: NaN or 0 here loads, then generates U+FFFD text that scores.
POSITIVE_FLOAT_FIELDS = ("rope_theta", "rms_norm_eps")
CONFIG_MAX_BYTES = 16 << 20  # a config.json is kilobytes; more is not one
# Up to this many parameters every value is checked for NaN/inf on load (a pass over the weights, about
# as long as reading them once); beyond it each tensor is checked at SAMPLED_VALUES evenly spaced values
# plus its first and last rows, and the error and docs say the check was sampled.
FULL_FINITE_CHECK_PARAMS = 4_000_000_000
SAMPLED_VALUES = 1 << 16
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
    config = read_json(config_file, "a model config (config.json)", max_bytes=CONFIG_MAX_BYTES)
    if not isinstance(config, dict):
        raise UserError(f"{config_file} must be a JSON object of config fields, got a {type(config).__name__}")
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise UserError(f"{config_file} has no model_type; a checkpoint's config names its architecture "
                        "(\"ouro\", \"melt\", \"llama\", ...)")
    _check_architectures(config_file, config)
    _check_positive_floats(config_file, config)
    if model_type not in LOOPED_TYPES:
        _check_known_architecture(config_file, config)
    if model_type in LOOPED_TYPES:
        for name in LOOPED_INT_FIELDS + LOOPED_OPTIONAL_INT_FIELDS:
            if name not in config or (config[name] is None and name in LOOPED_OPTIONAL_INT_FIELDS):
                continue
            value = config[name]
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UserError(f"{config_file}: {name} must be a whole number >= 1, got {value!r}")
    return config


def _check_architectures(config_file: Path, config: dict) -> None:
    """`architectures` names the class of `model_type`: a looped type only its own classes; any other type
    none of the looped classes, and no causal-LM class transformers maps to another model_type."""
    model_type, architectures = config["model_type"], config.get("architectures")
    if architectures is None:
        return
    if not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures):
        raise UserError(f"{config_file}: architectures must be a list of class names, got {architectures!r}")
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    others = {}  # causal-LM class name -> a model_type transformers loads it for
    for mtype, names in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        for name in (names,) if isinstance(names, str) else names:
            others.setdefault(name, mtype)
    for arch in architectures:
        owner = ARCHITECTURES.get(arch) or others.get(arch)
        if model_type in LOOPED_TYPES:
            if ARCHITECTURES.get(arch) == model_type:
                continue
            owner = owner or "another"
        elif owner is None or arch in _causal_lm_names(model_type):
            continue
        raise UserError(f"{config_file}: model_type {model_type!r} does not match its architecture {arch} "
                        f"(model_type {owner!r}); fix the config (architectures and model_type must agree)")


def _causal_lm_names(model_type: str) -> set:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    names = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type, ())
    return {names} if isinstance(names, str) else set(names)


def _check_positive_floats(config_file: Path, config: dict) -> None:
    """rope_theta and rms_norm_eps (top level, or in transformers' rope_parameters) finite and > 0."""
    rope = config.get("rope_parameters") if isinstance(config.get("rope_parameters"), dict) else {}
    for where, values in (("", config), ("rope_parameters.", rope)):
        for name in POSITIVE_FLOAT_FIELDS:
            if name not in values or values[name] is None:
                continue
            value = values[name]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise UserError(f"{config_file}: {where}{name} must be a finite number > 0, got {value!r}; fix the config")


def _check_known_architecture(config_file: Path, config: dict) -> None:
    """A non-looped checkpoint loads through transformers' own classes; one whose architecture only its
    repository's code defines (auto_map) is refused: melt-eval never sets trust_remote_code."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    model_type = config["model_type"]
    if model_type in CONFIG_MAPPING_NAMES:
        return
    if config.get("auto_map"):
        raise UserError(f"{config_file}: model_type {model_type!r} is defined by the checkpoint's own code (auto_map), "
                        "which needs trust_remote_code; melt-eval never runs a repository's code: use a model "
                        f"transformers {transformers.__version__} implements, or a LoopLM/MELT checkpoint")
    raise UserError(f"{config_file}: model_type {model_type!r} is unknown to transformers {transformers.__version__}; "
                    "upgrade transformers or pass a checkpoint of an architecture it implements")


def checkpoint_model_type(model_dir: Path) -> str:
    return read_config(model_dir)["model_type"]


def check_safetensors(path: Path) -> dict[str, tuple[str, list[int]]]:
    """{tensor name: (dtype, shape)} from a safetensors file's header, after checking that the file is
    whole: a readable header and every tensor's bytes inside the file (nothing is loaded)."""
    path = Path(path)
    size = check_regular_file(path, "a safetensors weights file", max_bytes=None)  # not a directory, FIFO or loop

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
    tensors, spans, end = {}, [], 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (start, stop) = info["dtype"], info["shape"], info["data_offsets"]
            assert isinstance(dtype, str) and all(isinstance(d, int) and d >= 0 for d in shape) and 0 <= start <= stop
        except (KeyError, TypeError, ValueError, AssertionError):
            bad(f"entry {name!r} has no valid dtype/shape/data_offsets")
        if dtype in DTYPE_BYTES and stop - start != math.prod(shape) * DTYPE_BYTES[dtype]:
            bad(f"tensor {name} of shape {list(shape)} {dtype} spans {stop - start} bytes")
        tensors[name] = (dtype, list(shape))
        spans.append((start, stop, name))
        end = max(end, stop)
    spans.sort()
    for (_, stop, first), (start, _, second) in zip(spans, spans[1:]):
        if start < stop:  # two tensors over the same bytes: writing one would change the other
            bad(f"tensors {first} and {second} share bytes")
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


def _check_pairs(model_dir: Path, tensors: dict[str, tuple[str, list[int]]]) -> None:
    """Each pair of tensors the model holds as one (k_proj/v_proj, gate_proj/up_proj, a_proj/h_proj) is whole and
    of one shape, checked before loading concatenates them (transformers would report the merged tensor, or a
    failed conversion): a missing or misshapen half is named as the checkpoint names it, with the pair's shapes."""
    missing, mismatched = [], []
    for merged, sources, _ in CHECKPOINT_LAYOUT:
        prefixes = {name[: -len(s)] for name in tensors for s in sources if name.endswith(s)}
        for prefix in prefixes:
            names = [prefix + s for s in sources]
            missing += [n for n in names if n not in tensors]
            if all(n in tensors for n in names) and len({tuple(tensors[n][1]) for n in names}) > 1:
                mismatched.append(" vs ".join(f"{n} {list(tensors[n][1])}" for n in names))
    parts = [f"missing tensors: {_names(missing)}"] if missing else []
    parts += [f"shape mismatches: {_names(mismatched)}"] if mismatched else []
    if parts:
        raise UserError(f"checkpoint {model_dir} does not match its config.json ({'; '.join(parts)}); "
                        "check num_hidden_layers, sizes and model_type")


def _check_loading_info(model_dir: Path, model, info: dict) -> None:
    """Config and weights agree: nothing missing, nothing left unused, every shape right (named as the checkpoint
    names them)."""
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    missing = [n for k in info.get("missing_keys", []) if not (k == "lm_head.weight" and tied) for n in checkpoint_names(k)]
    unused = list(info.get("unexpected_keys", []))
    mismatched = [n for m in info.get("mismatched_keys", []) for n in checkpoint_names(m[0] if isinstance(m, tuple) else m)]
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


def config_parameters(config: dict) -> int:
    """A lower bound on the parameters a decoder's config describes: the embedding and each layer's attention and
    MLP matrices (norms, biases, gates and an untied head left out); 0 for fields it does not name."""
    def num(key: str) -> int:
        value = config.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0

    hidden, heads = num("hidden_size"), num("num_attention_heads")
    kv_heads, head_dim = num("num_key_value_heads") or heads, num("head_dim") or (hidden // heads if heads else 0)
    attention = hidden * head_dim * 2 * (heads + kv_heads)  # q and o, k and v
    return num("vocab_size") * hidden + num("num_hidden_layers") * (attention + 2 * hidden * num("intermediate_size"))


def check_config_size(where, config: dict, dtype=torch.float32) -> None:
    """Refuse a config whose weights alone could not fit in this machine's memory, before any is allocated (a
    hidden_size of 1e9 made transformers print its load report and try a 2 TB allocation)."""
    from melt_eval.units import format_bytes

    params = config_parameters(config)
    need = params * torch.empty((), dtype=dtype).element_size()
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if need > memory:
        raise UserError(f"{where} describes a model of at least {params:,} parameters ({format_bytes(need)} as "
                        f"{str(dtype).removeprefix('torch.')}), more than this machine's {format_bytes(memory)} of memory; "
                        "check hidden_size, intermediate_size, num_hidden_layers and vocab_size against the weights")


def load_looped(model_dir: Path, dtype=torch.float32, device="cpu"):
    """Load an "ouro" or "melt" checkpoint strictly: every tensor present and used, every shape right."""
    config = read_config(model_dir)
    check_config_size(Path(model_dir) / "config.json", config, dtype)
    cls = MeltForCausalLM if config["model_type"] == "melt" else LoopLMForCausalLM
    if not any(Path(model_dir).glob("*.safetensors")):
        raise UserError(f"{model_dir} has no *.safetensors weights; pass a complete checkpoint directory")
    _check_pairs(model_dir, check_weights(model_dir))
    try:
        with quiet_transformers():
            # mismatched shapes are collected (and reported below by name) instead of raised
            model, info = cls.from_pretrained(model_dir, dtype=dtype, output_loading_info=True, ignore_mismatched_sizes=True)
    except _load_errors() as exc:
        raise UserError(f"cannot load {model_dir}: {_first_line(exc)}") from None
    _check_loading_info(model_dir, model, info)
    check_finite(model_dir, model)
    return model.to(device).eval()


def check_finite(model_dir: Path, model) -> None:
    """No NaN or inf in the weights (they generate U+FFFD text that still gets a score): every value up to
    FULL_FINITE_CHECK_PARAMS parameters, a sample of each tensor beyond (the message says which)."""
    params = list(model.named_parameters())
    full = sum(p.numel() for _, p in params) <= FULL_FINITE_CHECK_PARAMS
    with torch.no_grad():
        for name, p in params:
            flat = p.detach().reshape(-1)
            if not full and flat.numel() > SAMPLED_VALUES:
                step = flat.numel() // SAMPLED_VALUES
                rows = p.detach()[[0, -1]].reshape(-1) if p.dim() > 1 else flat[:0]
                flat = torch.cat([flat[::step], rows])
            for piece in flat.split(1 << 24):  # [16M] at a time: a bool copy of a whole embedding is large
                if not bool(torch.isfinite(piece).all()):
                    how = "every value checked" if full else f"sampled check: {SAMPLED_VALUES} values per tensor"
                    raise UserError(f"{model_dir}: tensor {name} holds NaN or inf values ({how}); the weights are "
                                    "damaged: re-download or re-save the checkpoint")


def check_chat_template(model_dir: Path, tokenizer) -> None:
    """The chat template compiles and renders a one-message conversation in transformers' sandboxed Jinja
    environment, at load time: broken Jinja or a template reaching outside the sandboxed environment
    (template injection) is a one-line error, not a traceback in the middle of a run."""
    if not getattr(tokenizer, "chat_template", None):
        return
    from jinja2.exceptions import TemplateError

    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "1 + 1 = ?"}], tokenize=False,
                                      add_generation_prompt=True)
    except TemplateError as exc:
        raise UserError(f"the chat template of {model_dir} cannot be used ({type(exc).__name__}: {_first_line(exc)}); "
                        "fix chat_template in tokenizer_config.json or chat_template.jinja") from None


def check_files(model_dir: Path) -> None:
    """Every file the loaders open (configs, tokenizer files, weights, templates) is a regular file: a FIFO
    would block the open forever, a directory or symlink loop would fail inside transformers."""
    for path in sorted(Path(model_dir).iterdir()):
        if path.name.endswith((".json", ".safetensors", ".jinja", ".txt", ".model")):
            check_regular_file(path, "a checkpoint file", max_bytes=None)


def load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as exc:  # tokenizers and transformers raise many types for a broken file
        files = sorted(p.name for p in Path(model_dir).iterdir() if p.name.startswith(("tokenizer", "vocab", "merges",
                                                                                         "special_tokens")))
        raise UserError(f"cannot load the tokenizer of {model_dir} ({', '.join(files) or 'no tokenizer files'}): "
                        f"{_first_line(exc)}; fix or re-download those files") from None
    check_chat_template(model_dir, tokenizer)
    return tokenizer


# A Hugging Face repository id: ORG/NAME, letters, digits, "-", "_" and "." (no "--" or ".." inside).
HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}$")
# What a checkpoint needs from a Hub repository: config, tokenizer files, safetensors weights.
HUB_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"]
REFERENCE_HELP = "pass an existing checkpoint directory, a registry name (melt-eval models) or a Hub id ORG/NAME[@REVISION]"


@dataclass(frozen=True)
class ModelRef:
    """What `--model` names, read without touching the network: a local directory, a registry name, or a
    Hugging Face Hub repository (a registry name may stand for one) at a revision."""

    text: str  # as given (with "@REVISION" where the revision came as a parameter)
    path: Path | None = None  # a local directory
    spec: ModelSpec | None = None  # a registry name
    repo_id: str | None = None  # a Hub repository, fetched through huggingface_hub's cache
    revision: str | None = None

    @property
    def display(self) -> str:
        """The name results are filed under: the registry name, the Hub repository's name (with its
        revision where one was asked for), or the directory's name."""
        if self.spec is not None and self.revision is None:
            return self.spec.name
        if self.repo_id is not None:
            name = self.spec.name if self.spec is not None else self.repo_id.split("/")[1]
            return f"{name}@{self.revision}" if self.revision else name
        return self.path.resolve().name or "model"


def _path_like(text: str) -> bool:
    return text.startswith((".", "/", "~")) or "\\" in text or text.count("/") > 1 or text.endswith("/")


def parse_model_ref(name_or_path: str, revision: str | None = None) -> ModelRef:
    """`--model` (and a revision) checked locally: a directory that exists, a known registry name, or a
    well-formed Hub id ORG/NAME[@REVISION]; else a one-line UserError naming it. Never reaches the network."""
    text = str(name_or_path)
    if revision is not None and (not isinstance(revision, str) or not revision.strip() or any(c.isspace() for c in revision)):
        raise UserError(f"revision {revision!r} must be a branch, tag or commit of the Hub repository (no spaces)")
    if not text.strip():
        raise UserError(f"--model is empty; {REFERENCE_HELP}")
    path = Path(text).expanduser()
    if path.is_dir():
        if revision is not None:
            raise UserError(f"--model {text}: a revision ({revision}) applies to Hub ids (ORG/NAME), not a local directory")
        return ModelRef(text, path=path)
    if text in MODELS:
        spec = MODELS[text]
        if revision is not None and spec.hub_id is None:
            raise UserError(f"--model {text}: a revision ({revision}) applies to Hub models; {text} is {spec.source}")
        if spec.hub_id is not None and revision is not None:
            return ModelRef(f"{text}@{revision}", spec=spec, repo_id=spec.hub_id, revision=revision)
        return ModelRef(text, spec=spec, repo_id=spec.hub_id)
    if path.exists():  # a file where a checkpoint directory was meant (e.g. its model.safetensors)
        raise UserError(f"--model {text!r} is a file, not a checkpoint directory; pass the directory holding its "
                        "config.json and weights")
    if _path_like(text):
        raise UserError(f"checkpoint directory {text!r} does not exist; {REFERENCE_HELP}")
    repo, at, rev = text.partition("@")
    if at:
        if not rev or any(c.isspace() for c in rev):
            raise UserError(f"--model {text!r}: the revision after '@' is empty or has spaces; {REFERENCE_HELP}")
        if revision is not None and revision != rev:
            raise UserError(f"--model {text!r} names revision {rev}, the revision parameter {revision}; give one")
        revision = rev
    if repo in MODELS and MODELS[repo].hub_id is not None:  # a registry alias at a revision
        return ModelRef(text if at else f"{repo}@{revision}", spec=MODELS[repo], repo_id=MODELS[repo].hub_id,
                        revision=revision)
    if "/" not in repo:
        get_spec(repo)  # unknown model: the error lists the registry names
    if not HUB_ID.match(repo) or "--" in repo or ".." in repo:
        raise UserError(f"--model {text!r} is neither an existing directory nor a Hub id ORG/NAME[@REVISION]; "
                        f"{REFERENCE_HELP}")
    return ModelRef(repo + (f"@{revision}" if revision else ""), repo_id=repo, revision=revision)


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) as huggingface_hub reads it, when it is imported."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


_REACHABLE: dict[str, bool] = {}


def hub_reachable(timeout: float = 3.0) -> bool:
    """One quick TCP connection to the Hub's endpoint (once per process): without a network, the model is
    looked up in the local cache only instead of spending seconds in the Hub client's retries. With a
    proxy configured the client is trusted to reach the Hub through it."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True
    url = urlparse(constants.ENDPOINT)
    host, port = url.hostname or "huggingface.co", url.port or (443 if url.scheme == "https" else 80)
    if f"{host}:{port}" not in _REACHABLE:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            _REACHABLE[f"{host}:{port}"] = True
        except OSError:
            _REACHABLE[f"{host}:{port}"] = False
    return _REACHABLE[f"{host}:{port}"]


def fetch_hub_model(ref: ModelRef, local_only: bool | None = None) -> Path:
    """The snapshot directory of a Hub model (config, tokenizer, safetensors) in the standard Hugging Face
    cache: downloaded where missing, or, offline (HF_HUB_OFFLINE=1, or the Hub unreachable), looked up in
    the cache alone; a model that is not there is one UserError naming it."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    offline = hub_offline()
    if local_only is None:
        local_only = offline or not hub_reachable()
    name = ref.repo_id + (f"@{ref.revision}" if ref.revision else "")
    try:
        return Path(snapshot_download(ref.repo_id, revision=ref.revision, allow_patterns=HUB_PATTERNS,
                                      local_files_only=local_only))
    except (LocalEntryNotFoundError, OfflineModeIsEnabled, FileNotFoundError):
        why = "HF_HUB_OFFLINE=1 is set" if offline else (
            f"the Hub ({constants.ENDPOINT}) is unreachable" if local_only else "the Hub did not answer")
        raise UserError(f"model {name} is not in the local Hugging Face cache ({constants.HF_HUB_CACHE}) and {why}; "
                        f"download it where the Hub is reachable (hf download {ref.repo_id}) or pass a checkpoint "
                        "directory") from None
    except GatedRepoError:
        raise UserError(f"model {name} is gated on the Hugging Face Hub: accept its terms and log in "
                        "(hf auth login), or pass a checkpoint directory") from None
    except RepositoryNotFoundError:
        raise UserError(f"model {name}: no such repository on the Hugging Face Hub (or it is private: log in with "
                        "hf auth login)") from None
    except RevisionNotFoundError:
        raise UserError(f"model {name}: the repository {ref.repo_id} has no revision {ref.revision!r}") from None
    except (HfHubHTTPError, OSError, ValueError) as exc:
        raise UserError(f"could not fetch model {name} from the Hugging Face Hub ({type(exc).__name__}: "
                        f"{_first_line(exc)}); download it where the Hub is reachable and pass its directory") from None


def check_model(name_or_path: str, revision: str | None = None) -> ModelRef:
    """`--model` checked before any dataset or model is loaded: its form (parse_model_ref) and, offline,
    that a Hub model is in the local cache (a cache look-up, no network)."""
    ref = parse_model_ref(name_or_path, revision)
    if ref.repo_id is not None and hub_offline():
        fetch_hub_model(ref, local_only=True)
    return ref


def resolve_model_dir(name_or_path: str, revision: str | None = None, verify: bool = True) -> Path:
    """Return a local checkpoint directory for a registry name, a path, or a Hub id ORG/NAME[@REVISION]
    (fetched through huggingface_hub's cache; `revision` is a branch, tag or commit). verify: check a
    local directory's files against its SHA256SUMS where it has one (melt_eval.files.verify_sums)."""
    ref = parse_model_ref(name_or_path, revision)
    if ref.path is not None:
        if verify:
            verify_sums(ref.path)
        return ref.path
    spec = ref.spec
    if spec is not None and spec.tiny:
        return build_tiny_model(spec.name, cache_home() / "models")
    if spec is not None and spec.name == "melt-1.6b":
        env = os.environ.get("MELT_EVAL_MELT_1_6B")
        if env and Path(env).is_dir():
            return Path(env)
        raise UserError(
            "melt-1.6b is not released: train it with `melt-eval train --recipe paper-phase1 --from "
            "ouro-1.4b-thinking ...` (then paper-phase2) and pass the output directory, or set MELT_EVAL_MELT_1_6B"
        )
    return fetch_hub_model(ref)


def load_model(name_or_path: str | Path, dtype=torch.float32, device="cpu", revision: str | None = None,
               verify: bool = True):
    """(model, tokenizer) for a registry name or a checkpoint directory; the checkpoint is checked first
    (its SHA256SUMS unless verify is False, config.json, every weights file, config and weights agreeing),
    so a broken one is a UserError."""
    model_dir = resolve_model_dir(str(name_or_path), revision, verify)
    check_files(model_dir)
    if checkpoint_model_type(model_dir) in LOOPED_TYPES:
        model = load_looped(model_dir, dtype=dtype, device=device)
    else:
        from transformers import AutoModelForCausalLM

        check_config_size(Path(model_dir) / "config.json", read_config(model_dir), dtype)
        check_weights(model_dir)
        try:
            with quiet_transformers():
                model, info = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, output_loading_info=True)
        except _load_errors() as exc:
            raise UserError(f"cannot load {model_dir}: {_first_line(exc)}") from None
        _check_loading_info(model_dir, model, info)
        check_finite(model_dir, model)
        model = model.to(device).eval()
    return model, load_tokenizer(model_dir)
