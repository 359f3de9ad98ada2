"""`InferenceOptions`: how a model generates (loops, KV sharing, prompt chunk, sampling), checked once.

The CLI builds one (`melt-eval run` flags), `run_tasks` resolves the per-task sampling defaults
(`for_task`), and the LightEval model and the generation backends (native engine, vLLM) read it
whole. Every check of these values lives here; a wrong value is a one-line UserError naming the
flag and the values it takes. Whether `kv_sharing` fits a model's cache is for
`melt_eval.cache_layout` to say, which also owns the values it takes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path

from melt_eval.cache_layout import LOOPED, check_kv_cache_dtype, check_kv_sharing, compressed_layout, layout_of
from melt_eval.errors import UserError
from melt_eval.files import TRAINING_META

DEFAULT_PREFILL_CHUNK = 1  # exact MELT: where neither --prefill-chunk nor the checkpoint's training says otherwise


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _at_least_one(value) -> bool:
    return _whole(value) and value >= 1


def _number(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


# What each sampling value must be, and how an error names it, in the order they are checked: in a run's
# spelling (its flags; `Sampling`) or in `generate()`'s (the native engine, whose callers pass the values
# one by one, as vLLM's SamplingParams; it takes no seed to check, and no value may be left to a task).
_SAMPLING_RULES = {
    "samples": _at_least_one,
    "max_new_tokens": _at_least_one,
    "temperature": lambda v: _number(v) and v >= 0,
    "top_p": lambda v: _number(v) and 0 < v <= 1,
    # LightEval takes no negative seed, and a problem's seed is the run's modulo 2**62 (`problem_seed`): above it,
    # two seeds would draw the same samples
    "seed": lambda v: _whole(v) and 0 <= v < 2**62,
}
_SAMPLING_ERRORS = {
    "flags": {
        "samples": "--samples must be at least 1, got {!r}",
        "max_new_tokens": "--max-new-tokens must be at least 1, got {!r}",
        "temperature": "--temperature must be a finite number, 0 (greedy) or more, got {}",
        "top_p": "--top-p must be in (0, 1], got {}",
        "seed": "--seed must be a whole number from 0 to 2**62 - 1, got {!r}",
    },
    "arguments": {
        "max_new_tokens": "max_new_tokens must be a whole number >= 1, got {!r}",
        "samples": "the number of samples must be a whole number >= 1, got {!r}",
        "temperature": "temperature must be a finite number >= 0 (0 = greedy), got {!r}",
        "top_p": "top_p must be in (0, 1], got {!r}",
    },
}


@dataclass(frozen=True)
class Sampling:
    """Samples per problem and how each is drawn. `samples`/`max_new_tokens` None: the task's own
    (the paper's protocol); `seed` is the run's, from which every problem's seed is derived."""

    samples: int | None = None
    temperature: float = 1.0
    top_p: float = 0.7
    max_new_tokens: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        self.check(vars(self))

    @staticmethod
    def check(values: dict, *, spelling: str = "flags", error: type[Exception] = UserError) -> None:
        """The one check of sampling values: an `error` naming the first wrong one, in `spelling` ("flags":
        a run's, where samples and max_new_tokens may be None; "arguments": the native engine's)."""
        for name, message in _SAMPLING_ERRORS[spelling].items():
            value = values[name]
            if value is None and spelling == "flags" and name in ("samples", "max_new_tokens"):
                continue  # the task's own
            if not _SAMPLING_RULES[name](value):
                raise error(message.format(value))


@dataclass(frozen=True)
class InferenceOptions:
    """How the model runs: loops T (None: the checkpoint's), untrained KV sharing ("first" | "last",
    Ouro only) and whether it covers the prompt, the prompt chunk C (1 = exact MELT; None: what the
    checkpoint was trained with, `for_checkpoint`), and sampling."""

    loops: int | None = None
    kv_sharing: str | None = None
    share_prompt: bool = False
    prefill_chunk: int | None = None
    sampling: Sampling = field(default_factory=Sampling)
    exit: str | None = None  # early exit of generated tokens: "gate:Q" | "agree:K" (None: all loops)
    # how the cache stores its entries (melt_eval.cache_layout.KVQuant): "auto" (the model's dtype), or KIVI's
    # fp8 | int8 | int4; cross_loop_kv: Ouro's loops 2..T as int4 deltas from loop 1 (native engine only)
    kv_cache_dtype: str = "auto"
    cross_loop_kv: bool = False
    # native engine on CUDA: the decode token step compiled and replayed as a CUDA graph (generation/decode_step.py);
    # False (--no-cuda-graphs) runs it eagerly. How the step runs, not what it computes: not part of a run's identity
    cuda_graphs: bool = True

    def __post_init__(self) -> None:
        if self.loops is not None and (not _whole(self.loops) or self.loops < 1):
            raise UserError(f"--loops must be at least 1, got {self.loops!r}")
        check_kv_sharing(self.kv_sharing)
        check_kv_cache_dtype(self.kv_cache_dtype)
        if not isinstance(self.cross_loop_kv, bool):
            raise UserError(f"--cross-loop-kv is a flag, got {self.cross_loop_kv!r}")
        if not isinstance(self.cuda_graphs, bool):
            raise UserError(f"--cuda-graphs/--no-cuda-graphs is a flag, got {self.cuda_graphs!r}")
        if self.prefill_chunk is not None and not (_whole(self.prefill_chunk) and 1 <= self.prefill_chunk <= MAX_RECORDED):
            raise UserError(f"--prefill-chunk must be a whole number from 1 to {MAX_RECORDED} (no prompt is longer), "
                            f"got {self.prefill_chunk!r}")
        rule = parse_exit(self.exit)
        if rule is not None and (self.kv_cache_dtype != "auto" or self.cross_loop_kv):
            # the early-exit step writes the caches' own tensors; the compressed stores are not among them
            raise UserError("--exit runs with the model's own cache: drop --kv-cache-dtype/--cross-loop-kv, or --exit")
        # gate:1 is every loop (the default): one spelling, so the run's identity and its tokens are today's
        object.__setattr__(self, "exit", None if rule is None else f"{rule[0]}:{rule[1]:g}")
        if not isinstance(self.sampling, Sampling):
            raise TypeError(f"sampling must be a Sampling, got {type(self.sampling).__name__}")

    @classmethod
    def from_flags(cls, **flags) -> "InferenceOptions":
        """From the `melt-eval run` flags' spelling: samples, temperature, top_p, max_new_tokens and seed
        go to `sampling`, the rest are fields (a name that is neither is a TypeError)."""
        sampling = {k: flags.pop(k) for k in ("samples", "temperature", "top_p", "max_new_tokens", "seed") if k in flags}
        return cls(**flags, sampling=Sampling(**sampling))

    def for_task(self, samples: int, max_new_tokens: int) -> "InferenceOptions":
        """These options with the task's sample count and length where the run left them open."""
        s = self.sampling
        return replace(self, sampling=replace(s, samples=s.samples or samples,
                                              max_new_tokens=s.max_new_tokens or max_new_tokens))

    def apply_loops(self, config) -> int:
        """The number of loops T a looped model runs with under these options, written into its config
        (`total_ut_steps`) and returned: `loops` where set, else the checkpoint's own. The one place --loops
        is applied: a run's config (its fingerprint, results.json's "loops", the native model) and the
        native engine's per-call T (which it restores) both come from here."""
        if self.loops is not None:
            config.total_ut_steps = self.loops
        return config.total_ut_steps

    @property
    def chunk(self) -> int:
        """The prompt chunk C to run with: `prefill_chunk`, or 1 where it was left to a checkpoint that
        `for_checkpoint` has not read (the engine called directly)."""
        return DEFAULT_PREFILL_CHUNK if self.prefill_chunk is None else self.prefill_chunk

    def for_checkpoint(self, model_dir: str | Path) -> tuple["InferenceOptions", str | None]:
        """These options with `prefill_chunk` decided: --prefill-chunk where given, else what the checkpoint
        in `model_dir` was trained with (`trained_prefill_chunk`); and a line saying where that default
        came from (None where the option was given). The one place the default is chosen (run, serve)."""
        if self.prefill_chunk is not None:
            return self, None
        chunk, why = checkpoint_prefill_chunk(model_dir)
        if not (Path(model_dir) / TRAINING_META).exists():  # today's default, as for any model: nothing to say
            return replace(self, prefill_chunk=chunk), None
        return replace(self, prefill_chunk=chunk), f"--prefill-chunk {chunk}: {why} (pass --prefill-chunk to change it)"

    @property
    def exit_rule(self) -> tuple[str, float] | None:
        """("gate", q) or ("agree", k) for `exit`, None when every generated token runs all loops."""
        return parse_exit(self.exit)

    @property
    def sets_model_options(self) -> bool:
        """Whether any option beyond sampling is set (they apply to looped models only)."""
        return (self.loops is not None or bool(self.kv_sharing) or self.share_prompt
                or self.prefill_chunk not in (None, DEFAULT_PREFILL_CHUNK) or self.exit is not None
                or self.kv_cache_dtype != "auto" or self.cross_loop_kv)

    def check_model(self, config: dict | None, native: bool = True) -> None:
        """What the loaded model would refuse, checked from its config fields (`model_facts`) before it loads:
        --loops, --exit and KV sharing on a model that is not looped; on the native engine, the cache these
        options make (--cross-loop-kv, --kv-cache-dtype, --kv-sharing, --share-prompt: `cache_layout`'s errors)."""
        if config is None:
            return
        if config.get("model_type") not in LOOPED:
            for flag, given in (("--loops", self.loops is not None), ("--exit", self.exit is not None)):
                if given:
                    raise UserError(f"{flag} applies to looped models (Ouro, MELT) only")
            if self.kv_sharing or self.share_prompt:
                raise UserError("--kv-sharing and --share-prompt apply to LoopLM (Ouro) models only")
        if not native:
            return
        try:
            layout = layout_of(config, loops=self.loops, kv_sharing=self.kv_sharing, share_prompt=self.share_prompt)
            compressed_layout(layout, self.kv_cache_dtype, self.cross_loop_kv)
        except UserError:
            raise
        except (TypeError, ValueError, KeyError, ZeroDivisionError):
            return  # fields the loaders refuse by name once they read them


CONFIG_MAX_BYTES = 16 << 20  # a config.json is kilobytes (melt_eval.modeling.loading reads it whole)


def model_facts(model: str) -> dict | None:
    """The config fields a run's options are checked against, read without loading anything: a checkpoint
    directory's config.json, or a registry model's facts; None where they are not known so (a Hub id, a
    config.json that is not a regular file holding a JSON object: the loaders name what is wrong)."""
    import json

    from melt_eval.registry import MODELS

    path = Path(str(model)).expanduser()
    if path.is_dir():
        config_file = path / "config.json"
        try:  # a regular file only: a FIFO would block the read
            if not config_file.is_file() or config_file.stat().st_size > CONFIG_MAX_BYTES:
                return None
            config = json.loads(config_file.read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError):
            return None
        return config if isinstance(config, dict) else None
    spec = MODELS.get(str(model))
    if spec is None:
        return None
    facts = {"model_type": spec.family, "num_hidden_layers": spec.num_layers, "num_attention_heads": spec.num_heads,
             "num_key_value_heads": spec.num_kv_heads, "head_dim": spec.head_dim, "hidden_size": spec.hidden_size,
             "total_ut_steps": spec.loops}
    return facts if spec.family in LOOPED or None not in facts.values() else {"model_type": spec.family}


def trained_prefill_chunk(recipe: dict) -> tuple[int, str] | None:
    """The prompt chunk a MELT recipe trained with, and why (docs/method.md#prefill): the prompt whole where
    it trained the prompt as one chunk (`prompt_as_one_chunk`, or chunk_size 0, the whole sequence) -- a chunk
    of its seq_len, which holds any prompt it trained on, as the demo prefills -- else its chunk_size. None
    where the recipe trains no shared KV cache (target looplm: Ouro's per-loop caches make chunks irrelevant)
    or its values are not whole numbers >= 1 (`record_problem` names which)."""
    if recipe.get("target", "melt") != "melt":
        return None
    chunk, seq_len = recipe.get("chunk_size"), recipe.get("seq_len")
    if recipe.get("prompt_as_one_chunk") is True or chunk == 0:
        rule = "prompt_as_one_chunk" if recipe.get("prompt_as_one_chunk") is True else "chunk_size 0"
        return (seq_len, f"the prompt whole, as trained ({rule}; seq_len {seq_len})") if _at_least_one(seq_len) else None
    return (chunk, f"as trained (chunk_size {chunk})") if _at_least_one(chunk) else None


MAX_RECORDED = (1 << 31) - 1  # no context is longer: a larger chunk or seq_len is damage, not a setting
RECORD_TARGETS = ("melt", "looplm", "exit_gate")  # training.config.TARGETS (not imported: inference stays light)


def record_problem(recipe) -> str | None:
    """What is wrong with the fields of a training record's recipe that inference reads (target,
    prompt_as_one_chunk, chunk_size and, where the prompt is one chunk, seq_len), as a phrase naming the
    field; None when they are sound."""
    if not isinstance(recipe, dict):
        return f"its recipe is a {type(recipe).__name__}, not a mapping"
    target = recipe.get("target", "melt")
    if target not in RECORD_TARGETS:
        return f"recipe field target is {target!r}, not one of {', '.join(RECORD_TARGETS)}"
    if target != "melt":
        return None  # no shared KV cache: no field of the chunk rule is read
    whole = recipe.get("prompt_as_one_chunk", False)
    if not isinstance(whole, bool):
        return f"recipe field prompt_as_one_chunk is {whole!r}, not true or false"
    chunk = recipe.get("chunk_size")
    if not whole and not (_whole(chunk) and 0 <= chunk <= MAX_RECORDED):
        return f"recipe field chunk_size is {chunk!r}, not a whole number from 0 to {MAX_RECORDED}"
    seq_len = recipe.get("seq_len")
    if (whole or chunk == 0) and not (_at_least_one(seq_len) and seq_len <= MAX_RECORDED):
        return f"recipe field seq_len is {seq_len!r}, not a whole number from 1 to {MAX_RECORDED}"
    return None


def checkpoint_prefill_chunk(model_dir: str | Path) -> tuple[int, str]:
    """(prompt chunk, where it comes from) for the checkpoint in `model_dir`: its training record's rule
    (`TRAINING_META`'s recipe, `trained_prefill_chunk`), else DEFAULT_PREFILL_CHUNK, saying why.

    A record this harness wrote decides what the run computes (its prefill chunk is part of the run's
    identity), so a damaged one stops the run, as a damaged run.json does, with one line naming the field
    (--prefill-chunk decides without reading it); a directory without a record takes the default."""
    from melt_eval.jsonio import read_json

    path = Path(model_dir) / TRAINING_META
    default = f"the default ({DEFAULT_PREFILL_CHUNK}, exact MELT)"
    if not (path.exists() or path.is_symlink()):
        return DEFAULT_PREFILL_CHUNK, f"{default}: no training record ({TRAINING_META}) in {model_dir}"
    fix = "; fix or restore it, or pass --prefill-chunk N to choose the prompt chunk without it"
    try:
        meta = read_json(path, "a training record")
    except UserError as exc:
        raise UserError(f"{exc}{fix}") from None
    if not isinstance(meta, dict):
        raise UserError(f"{path} is a JSON {type(meta).__name__}, not the training record's object{fix}")
    # an exit-gate fit keeps the checkpoint's own training recipe as model_recipe (the gate changes no chunk rule)
    recipe = meta.get("model_recipe") or meta.get("recipe")
    if (problem := record_problem(recipe)) is not None:
        raise UserError(f"{path}: {problem}{fix}")
    trained = trained_prefill_chunk(recipe)
    if trained is None:
        return DEFAULT_PREFILL_CHUNK, f"{default}: {path}'s recipe (target {recipe.get('target')!r}) sets no prompt chunk"
    chunk, why = trained
    return chunk, f"{why}, from {path}"


EXIT_HELP = ("--exit must be gate:Q with 0 < Q <= 1 (stop at the first loop where Ouro's cumulative exit "
             "probability reaches Q) or agree:K with K >= 1 (stop once the top token stays the same K more loops)")


def parse_exit(spelling: str | None) -> tuple[str, float] | None:
    """The one check of `--exit`: ("gate", q) | ("agree", k) | None (all loops; also gate:1)."""
    if spelling is None:
        return None
    kind, sep, value = str(spelling).strip().partition(":")
    try:
        number = float(value) if kind == "gate" else int(value)
    except ValueError:
        number = None
    if not sep or kind not in ("gate", "agree") or number is None or not math.isfinite(number):
        raise UserError(f"{EXIT_HELP}, got {spelling!r}")
    if kind == "gate" and not 0 < number <= 1 or kind == "agree" and number < 1:
        raise UserError(f"{EXIT_HELP}, got {spelling!r}")
    if kind == "gate" and number == 1:
        return None
    return kind, number
