"""Training recipes: one flat dataclass, loaded from YAML, overridden by flags and `--set`.

A recipe is a small YAML file in `melt_eval/recipes/` (or any path). Resolution order, last wins:
recipe file -> `--config FILE` -> `--set key=value` -> the explicit CLI switches
(`--gate`, `--chunk-size`, ...). Every key is a field of `Recipe`; unknown keys are
rejected with the list of valid ones, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from melt_eval.errors import UserError
from melt_eval.jsonio import read_text

RECIPES_DIR = Path(__file__).resolve().parents[1] / "recipes"  # package data: shipped in the wheel
# how a run executes, not what it computes: may change on resume, left out of run identities
EXECUTION_FIELDS = {"compile", "log_with"}
# fields added after run identities were first published, with the value every earlier run had: at that
# value a field is left out of a run's identity, so a run an older melt-eval trained is found, not retrained
ADDED_FIELDS = {"prompt_as_one_chunk": False, "kv_heads": None, "exit_gate_k": 50.0, "exit_gate_gamma": 0.005,
                "lr_schedule_steps": None, "stop_at_heldout": None,
                "exit_aware_p": 0.0, "exit_aware_loops": []}
# what is trained: MELT (converted or continued), a plain LoopLM, or only the early-exit gate of either
TARGETS = ("melt", "looplm", "exit_gate")
OVERLONG = ("keep", "truncate", "drop")
MIXED_PRECISION = ("auto", "bf16", "fp16", "no")


@dataclass
class Recipe:
    # --- what is trained -------------------------------------------------------------------
    target: str = "melt"  # "melt": convert/continue a MELT model; "looplm": plain LM training of a LoopLM;
    # "exit_gate": only Ouro's early-exit gate of a LoopLM or MELT checkpoint, by Ouro's stage-II objective on the
    # model's own loop states, every other weight frozen (docs/training.md#fitting-the-exit-gate)
    phase: int = 1  # 1: interpolated transition + KD; 2: KD + attention alignment (continues phase 1)
    from_model: str | None = None  # registry name or checkpoint dir (`--from`)
    from_scratch: bool = False  # re-initialise the weights of `from_model` (LoopLM pretraining)
    model_overrides: dict = field(default_factory=dict)  # config fields changed before a from-scratch init
    gate: str = "elementwise"  # MELT gate when converting a LoopLM (elementwise|scalar|ema|mean|last|first)
    ema_decay: float = 0.2
    gate_seed: int = 0
    # Grouped-query MELT: mean-pool the key/value heads into K groups when converting (docs/training.md#grouped-query-melt);
    # None keeps the LoopLM's heads. K must divide its key/value heads.
    kv_heads: int | None = None
    teacher: str | None = None  # frozen LoopLM for KD/alignment; phase 1 default: the starting LoopLM
    # --- objective (docs/method.md#losses) ------------------------------------------------------
    chunk_size: int = 500  # C; 0 = the whole sequence (C = L, "no chunk-wise training")
    # The prompt as one chunk, the reply in chunks of C: the rule of a prefill chunk at least as long as the
    # prompt (vLLM prefills a prompt whole). The chunk is the micro-batch's shortest prompt.
    prompt_as_one_chunk: bool = False
    interpolation_steps: int = 500  # alpha: 0 -> 1 linearly over these optimiser steps; 0 = alpha 1 throughout
    kd: bool = True  # all-loop KD against the teacher; False = plain SFT (final-loop cross-entropy)
    kd_beta: float = 0.0  # generalised JSD beta: 0 = forward KL(teacher || student), 1 = reverse KL
    kd_temperature: float = 1.0
    ce_weight: float = 0.0  # extra final-loop cross-entropy added to the KD loss (0 = the paper's objective)
    # The cross-entropy term over loops: [] = the final loop's only (docs/method.md#sft); T weights = sum_t w_t CE_t,
    # every loop's exit predicting the next token, as Ouro is trained (its weights come from its exit gate)
    loop_ce_weights: list = field(default_factory=list)
    align_beta: float = 0.0  # attention-alignment weight beta (phase 2: 0.1); 0 = no alignment
    # target exit_gate: the continue label w_t = sigmoid(k * (I_{t+1} - gamma)), I_{t+1} = max(0, L_t - L_{t+1})
    # (Ouro's slope k and threshold gamma; docs/method.md#early-exit)
    exit_gate_k: float = 50.0
    exit_gate_gamma: float = 0.005
    # Exit-aware training (target melt or exit_gate, alpha 1; docs/training.md#exit-aware-fine-tuning): each reply token, with
    # probability exit_aware_p, leaves its shared-cache entry at a loop drawn uniformly from exit_aware_loops ([]:
    # 1..T-1), as `--exit` leaves an exited token's entry, so later tokens learn to read such entries. 0: off.
    exit_aware_p: float = 0.0
    exit_aware_loops: list = field(default_factory=list)
    # --- data --------------------------------------------------------------------------------
    data: list = field(default_factory=list)  # sources, see melt_eval.training.data.build_source
    seq_len: int = 10_000
    overlong: str = "keep"  # examples longer than seq_len: keep whole, truncate to seq_len, or drop (counted in the log)
    batch_tokens: int = 320_000  # tokens per optimiser step (sequence slots: seq_len x sequences)
    micro_batch_size: int = 1  # sequences per forward pass per process
    shuffle_buffer: int = 10_000  # streaming shuffle buffer for Hub sources
    # --- optimisation ----------------------------------------------------------------------
    max_steps: int = 500
    # The cosine's length. null: max_steps. Longer than max_steps stops training partway down the cosine,
    # with the learning rate still high: the state a longer run passes through at that step.
    lr_schedule_steps: int | None = None
    # Stop when the model has learned the task, not at a step count (melt_eval/training/heldout.py): every
    # `every` steps, pass@1 at `loops` loops on a held-out split of the synthetic task, disjoint from train and
    # test; the run stops, finished, once it reaches `target`. max_steps stays the cap. null: off.
    # e.g. {loops: 4, target: 0.8, every: 50, problems: 20, samples: 4} (samples 1: greedy)
    stop_at_heldout: dict | None = None
    lr: float = 8e-6
    gate_lr: float = 5e-4
    warmup_steps: int = 25
    min_lr_ratio: float = 0.0  # cosine decays to lr * min_lr_ratio
    weight_decay: float = 1e-4
    adam_betas: list = field(default_factory=lambda: [0.9, 0.95])
    adam_eps: float = 1e-8
    grad_clip: float = 1.0
    mixed_precision: str = "auto"  # auto: bf16 on GPU, fp32 on CPU
    gradient_checkpointing: bool = False
    # torch.compile each (layer, loop) step's pure parts (`compile_layer_step`); micro-batches are
    # then padded to a multiple of chunk_size so every chunk has one shape (no recompiles). MELT at
    # chunk 1 compiles each token's whole chunk instead (`compile_token_step`, O(L^2) memory, worth its
    # compile time at the demo's size: docs/results/2026-11-26-benchmarks.md#one-compiled-function-per-token).
    # captured: each (layer, loop) step whole, attention included, one graph forward and one for its recompute and
    # backward (`compile_captured_step`; one process)
    compile: bool | str = False  # true, false or captured; in EXECUTION_FIELDS
    seed: int = 0
    # --- bookkeeping -----------------------------------------------------------------------
    save_every: int = 100  # optimiser steps between resumable checkpoints (0 = only at the end)
    keep_checkpoints: int = 2
    log_every: int = 1
    # Accelerate trackers, comma-separated: tensorboard, wandb, trackio, mlflow, ... | all | none | auto
    # (auto: tensorboard where the package is installed). tensorboard: false (the older key) drops it.
    log_with: str = "auto"
    tensorboard: bool = True

    # ------------------------------------------------------------------------------------
    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def validate(self) -> "Recipe":
        def bad(msg: str):
            raise UserError(f"invalid recipe: {msg}")

        if self.target not in TARGETS:
            bad(f"target must be one of {TARGETS}, got {self.target!r}")
        if self.phase not in (1, 2):
            bad(f"phase must be 1 or 2, got {self.phase!r}")
        from melt_eval.modeling import GATES

        if self.gate not in GATES:
            bad(f"gate must be one of {', '.join(GATES)}, got {self.gate!r}")
        if self.overlong not in OVERLONG:
            bad(f"overlong must be one of {', '.join(OVERLONG)}, got {self.overlong!r}")
        from melt_eval.training.metrics import check_log_with

        check_log_with(self.log_with, bad)
        if self.mixed_precision not in MIXED_PRECISION:
            bad(f"mixed_precision must be one of {MIXED_PRECISION}, got {self.mixed_precision!r}")
        for name in ("chunk_size", "interpolation_steps", "warmup_steps", "save_every"):
            if getattr(self, name) < 0:
                bad(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("seq_len", "batch_tokens", "micro_batch_size", "max_steps", "log_every", "keep_checkpoints"):
            if getattr(self, name) < 1:
                bad(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.kd_beta <= 1.0:
            bad(f"kd_beta must be within [0, 1], got {self.kd_beta}")
        for name in ("align_beta", "ce_weight", "lr", "gate_lr", "weight_decay", "grad_clip"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                bad(f"{name} must be a finite number >= 0, got {v!r}")
        if not math.isfinite(self.kd_temperature) or self.kd_temperature <= 0:
            bad(f"kd_temperature must be a finite number > 0, got {self.kd_temperature}")
        if not math.isfinite(self.adam_eps) or self.adam_eps <= 0:
            bad(f"adam_eps must be a finite number > 0, got {self.adam_eps}")
        for name in ("ema_decay", "min_lr_ratio"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                bad(f"{name} must be within [0, 1], got {getattr(self, name)}")
        for name in ("seed", "gate_seed", "shuffle_buffer"):
            if getattr(self, name) < 0:
                bad(f"{name} must be >= 0, got {getattr(self, name)}")
        betas = self.adam_betas
        if not (isinstance(betas, list) and len(betas) == 2
                and all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in betas)):
            bad(f"adam_betas must be two numbers in [0, 1), e.g. [0.9, 0.95], got {betas!r}")
        w = self.loop_ce_weights
        if not (isinstance(w, list) and all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0 for x in w)
                and (not w or sum(w) > 0)):
            bad(f"loop_ce_weights must be [] or one number >= 0 per loop, not all 0, e.g. [0.25, 0.25, 0.25, 0.25]; got {w!r}")
        if self.prompt_as_one_chunk and self.compile and self.chunk_size > 1:  # at 0 (C = L) the prompt is in the one chunk
            bad("compile pads micro-batches to whole chunks from the first token; set prompt_as_one_chunk: false "
                "(or chunk_size: 1) to compile")
        if self.kv_heads is not None and not (_is_int(self.kv_heads) and self.kv_heads >= 1):
            bad(f"kv_heads must be a whole number >= 1 (or null), got {self.kv_heads!r}")
        if self.kv_heads is not None and self.target != "melt":
            bad("kv_heads converts a LoopLM to a grouped-query MELT: it applies to target melt only")
        if self.lr_schedule_steps is not None and not (_is_int(self.lr_schedule_steps) and self.lr_schedule_steps >= 1):
            bad(f"lr_schedule_steps must be a whole number >= 1 (or null: max_steps), got {self.lr_schedule_steps!r}")
        if not self.data:
            bad("data must list at least one source (see the recipes in melt_eval/recipes/)")
        check_data_sources(self.data, bad)
        check_sizes(self, bad)
        from melt_eval.training.heldout import check_spec

        check_spec(self.stop_at_heldout, self, bad)
        if self.target == "looplm" and (self.kd or self.align_beta or self.interpolation_steps):
            bad("target looplm trains a plain LoopLM: set kd: false, align_beta: 0, interpolation_steps: 0")
        if self.target == "exit_gate" and (self.kd or self.align_beta or self.interpolation_steps or self.ce_weight
                                           or self.loop_ce_weights or self.from_scratch or self.teacher):
            bad("target exit_gate fits only the exit gate on the model's own losses: set kd: false, align_beta: 0, "
                "interpolation_steps: 0, ce_weight: 0, loop_ce_weights: [], from_scratch: false and no teacher")
        if not (math.isfinite(self.exit_gate_k) and self.exit_gate_k > 0 and math.isfinite(self.exit_gate_gamma)):
            bad(f"exit_gate_k must be a finite number > 0 and exit_gate_gamma finite, got {self.exit_gate_k}, "
                f"{self.exit_gate_gamma}")
        check_exit_aware(self, bad)
        if self.phase == 2 and self.interpolation_steps:
            bad("phase 2 continues at alpha = 1: set interpolation_steps: 0")
        check_unused_keys(self, bad)
        return self

    def grad_accum_steps(self, world_size: int = 1) -> int:
        """Micro-batches per optimiser step so that a step sees `batch_tokens` sequence slots."""
        per_micro = self.seq_len * self.micro_batch_size * world_size
        return max(1, round(self.batch_tokens / per_micro))

    def alpha(self, step: int) -> float:
        """Interpolation weight at optimiser step `step` (0-based): 0 -> 1 linearly, then 1."""
        if self.target != "melt" or self.interpolation_steps == 0:
            return 1.0
        return min(1.0, step / self.interpolation_steps)

    def needs_teacher(self) -> bool:
        return self.target == "melt" and (self.kd or self.align_beta > 0)

    def needs_loop_states(self) -> bool:
        """Whether the objective reads every loop's hidden state (all-loop KD, alignment, per-loop CE)."""
        return self.kd or self.align_beta > 0 or bool(self.loop_ce_weights) or self.target == "exit_gate"


def compile_unused(recipe: "Recipe", compile=None) -> str | None:
    """Why `compile` (default: the recipe's) would leave this recipe's training eager, or None where it applies
    (melt_eval.training.build.prepare_student; modeling/token_step.py `applies`)."""
    compile = recipe.compile if compile is None else compile
    if not compile:
        return None
    if recipe.target == "exit_gate":
        spelled = str(compile).lower()  # as a recipe spells it: true, captured
        return f"target exit_gate runs the model frozen, which is never compiled: set compile: false (got {spelled})"
    if compile == "captured" and recipe.gradient_checkpointing:
        # looplm.run_chunk: a captured step keeps only its inputs and recomputes itself in its backward, so the
        # checkpointing flag is never read; recorded true, it would claim a setting that changed nothing
        return ("compile: captured keeps only each (layer, loop) step's inputs and recomputes the step in its "
                "backward, its own activation checkpoint, so gradient_checkpointing would change nothing: set "
                "gradient_checkpointing: false")
    if compile is True and recipe.target == "melt" and recipe.chunk_size == 1 and (
            recipe.gradient_checkpointing or recipe.exit_aware_p > 0):
        return ("compile: true at chunk_size 1 compiles each token's whole step, which runs neither under "
                "gradient_checkpointing nor with exit_aware_p > 0, so the run would be eager: set compile: captured "
                "(one process; it checkpoints each step itself, so with gradient_checkpointing: false) or compile: false")
    return None


def check_unused_keys(recipe: "Recipe", bad) -> None:
    """A key this target or combination would ignore is refused: what a run records is what ran (issue 69).
    Parameters of a feature another key turns off (kd_beta with kd: false, exit_aware_loops at exit_aware_p 0)
    are left alone: the record says the feature was off."""
    if (why := compile_unused(recipe)) is not None:
        bad(why)
    target = recipe.target
    if recipe.gradient_checkpointing and target == "exit_gate":
        bad("target exit_gate's frozen forward keeps no activations for a backward, so gradient checkpointing has "
            "nothing to recompute: set gradient_checkpointing: false")
    if recipe.phase != 1 and target != "melt":
        bad(f"phase picks MELT's training phase (2 continues a MELT checkpoint); target {target} has none: set phase: 1")
    defaults = {f.name: f.default for f in dataclasses.fields(Recipe)}
    if target != "melt":
        changed = [k for k in ("gate", "ema_decay", "gate_seed") if getattr(recipe, k) != defaults[k]]
        if changed:
            bad(f"{', '.join(changed)} set the gate a LoopLM is converted to MELT with; target {target} converts "
                f"nothing: leave {'it' if len(changed) == 1 else 'them'} at the default")
        if recipe.gate_lr != defaults["gate_lr"]:
            where = "the exit gate trains at lr" if target == "exit_gate" else "a LoopLM has none"
            bad(f"gate_lr is the learning rate of MELT's gates; target {target} trains none ({where}): drop gate_lr")
    if (recipe.model_overrides or recipe.from_scratch) and not (target == "looplm" and recipe.from_scratch):
        bad("from_scratch and model_overrides build a new LoopLM: they need target looplm and from_scratch: true "
            "(MELT and the exit gate start from a trained model)")
    if target != "exit_gate" and (recipe.exit_gate_k, recipe.exit_gate_gamma) != (defaults["exit_gate_k"],
                                                                                 defaults["exit_gate_gamma"]):
        bad(f"exit_gate_k and exit_gate_gamma shape target exit_gate's labels; target {target} fits no exit gate: "
            f"leave them at {defaults['exit_gate_k']:g} and {defaults['exit_gate_gamma']:g}")
    if recipe.ce_weight and not recipe.kd:
        bad("ce_weight adds cross-entropy to the KD loss; with kd: false the loss is the cross-entropy alone: "
            "set ce_weight: 0")
    if target == "looplm" and recipe.teacher is not None:
        bad("target looplm trains without a teacher: drop --teacher (teacher: null)")
    if target == "looplm" and recipe.prompt_as_one_chunk:
        bad("prompt_as_one_chunk sets MELT's chunks; a LoopLM's per-loop cache trains every token in one pass: "
            "set prompt_as_one_chunk: false")


def check_exit_aware(recipe: "Recipe", bad) -> None:
    """exit_aware_p / exit_aware_loops: a probability, whole loops >= 1, on a MELT at alpha 1 (a shared cache)."""
    p, loops = recipe.exit_aware_p, recipe.exit_aware_loops
    if not 0.0 <= p <= 1.0:
        bad(f"exit_aware_p must be within [0, 1], got {p}")
    if not (isinstance(loops, list) and all(_is_int(t) and t >= 1 for t in loops)):
        bad(f"exit_aware_loops must be [] (every loop before the last) or whole loops >= 1, e.g. [2, 3]; got {loops!r}")
    if p > 0 and (recipe.target not in ("melt", "exit_gate") or recipe.interpolation_steps):
        bad("exit_aware_p trains MELT to read early-exited entries of its shared cache: it needs target melt "
            "(or exit_gate, to fit the gate on such a cache) and interpolation_steps: 0 (alpha 1)")


# The keys each kind of data source takes (melt_eval.training.data builds them) and the type of each value.
DATA_KEYS = {
    "hub": {"source", "weight", "path", "name", "split"},
    "local": {"source", "weight", "path"},
    "synthetic": {"source", "weight", "n", "num_steps", "max_value", "target", "split", "seed", "form"},
}
_DATA_TYPES = {"path": str, "name": str, "split": str, "target": str, "form": str, "n": int, "max_value": int, "seed": int}
# A synthetic problem held in memory is a few hundred bytes of Python strings; 1 KiB bounds it
SYNTHETIC_ITEM_BYTES = 1024
# What one sequence slot costs the host before the model sees it: input ids, attention and loss masks as
# int64 (3 x 8 bytes) in the step's list of examples and its collated micro-batches (x 2)
SLOT_BYTES = 48


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_data_sources(data, bad) -> None:
    """Each `data` entry by type and finiteness, before anything is built (a wrong type is one line, not a
    traceback from deep in the data stream)."""
    if not isinstance(data, list):
        bad(f"data must be a list of sources, got {data!r}")
    for spec in data:
        if not isinstance(spec, dict) or spec.get("source") not in DATA_KEYS:
            bad(f"data source {spec!r}: needs `source` set to one of {', '.join(DATA_KEYS)}")
        kind = spec["source"]
        unknown = sorted(set(spec) - DATA_KEYS[kind])
        if unknown:
            bad(f"data source {kind}: unknown key(s) {', '.join(map(str, unknown))}; valid: {', '.join(sorted(DATA_KEYS[kind]))}")
        w = spec.get("weight", 1.0)
        if not (isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w) and w >= 0):
            bad(f"data source {kind}: weight must be a finite number >= 0, got {w!r}")
        for key, want in _DATA_TYPES.items():
            if key in spec and not (_is_int(spec[key]) if want is int else isinstance(spec[key], want)):
                bad(f"data source {kind}: {key} must be {'a whole number' if want is int else 'a string'}, got {spec[key]!r}")
        steps = spec.get("num_steps", 2)
        if not (_is_int(steps) or (isinstance(steps, list) and len(steps) == 2 and all(map(_is_int, steps)))):
            bad(f"data source {kind}: num_steps must be a whole number or [lo, hi], got {steps!r}")
        if kind == "synthetic" and spec.get("n", 1) < 1:
            bad(f"data source synthetic: n must be >= 1, got {spec['n']}")
    if sum(float(s.get("weight", 1.0)) for s in data) <= 0:
        bad("data source weights must have a positive sum")


def memory_bytes() -> int:
    """The host's physical memory: every example of a step is built there, whatever the device."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_sizes(recipe: "Recipe", bad, memory: int | None = None) -> None:
    """Refuse size-like values whose data alone would not fit in memory, before anything is allocated
    (a step draws micro_batch_size x accumulation examples at once; too many is a hang, not an error)."""
    memory = memory or memory_bytes()
    from melt_eval.units import format_bytes

    step_slots = recipe.seq_len * recipe.micro_batch_size * recipe.grad_accum_steps()
    needs = {"micro_batch_size": recipe.seq_len * recipe.micro_batch_size * SLOT_BYTES,
             "batch_tokens": step_slots * SLOT_BYTES,
             # a buffered Hub example is raw text: about 4 bytes per token
             "shuffle_buffer": recipe.shuffle_buffer * recipe.seq_len * 4}
    synthetic = [s.get("n", 10_000) for s in recipe.data if s.get("source") == "synthetic"]
    if synthetic:
        needs["data n"] = sum(synthetic) * SYNTHETIC_ITEM_BYTES
    for name, need in needs.items():
        if need > memory:
            lower = f"lower {name}" + (" or seq_len" if name != "data n" else " of the synthetic source")
            bad(f"{name} needs at least {format_bytes(need)} for its data alone, more than this machine's "
                f"{format_bytes(memory)} of memory; {lower}")


def _check_keys(raw: dict, origin: str) -> None:
    valid = Recipe.field_names()
    unknown = sorted(set(raw) - set(valid))
    if unknown:
        raise UserError(f"unknown recipe key(s) {', '.join(unknown)} in {origin}; valid keys: {', '.join(valid)}")


class _RecipeLoader(yaml.SafeLoader):
    """SafeLoader without aliases. A recipe never needs them, and a few nested levels of
    `b: [*a, *a, ...]` (an alias bomb) stand for billions of values once the recipe is copied."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(None, None, f"YAML aliases (*{event.anchor}) are not allowed in recipes",
                                              event.start_mark)
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):
        """A key given twice is refused: YAML's last-one-wins would drop the first value without a word."""
        if isinstance(node, yaml.MappingNode):
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                if isinstance(key, str) and key in seen:
                    raise yaml.constructor.ConstructorError(None, None, f"the key {key!r} is given twice",
                                                            key_node.start_mark)
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


def parse_yaml(text: str, origin: str):
    """YAML text of recipe values (a file, a --set value); a one-line UserError naming `origin` if it is not."""
    try:
        return yaml.load(text, Loader=_RecipeLoader)
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise UserError(f"{origin} is not valid YAML ({problem}{where})") from None
    except RecursionError:
        raise UserError(f"{origin} is nested too deeply to be a recipe") from None


def read_yaml_file(path: Path, what: str = "recipe"):
    # a FIFO would block the read, a device never end: refused before the open, as every file the harness reads
    return parse_yaml(read_text(path, f"a {what} YAML file"), str(path))


def _read_yaml(path: Path) -> dict:
    raw = read_yaml_file(path) or {}
    if not isinstance(raw, dict):
        raise UserError(f"{path} must be a mapping of recipe keys to values")
    _check_keys(raw, str(path))
    return raw


def available_recipes() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def recipe_path(name: str) -> Path:
    """A recipe name (file stem in melt_eval/recipes/) or a path to a YAML file."""
    path = Path(name).expanduser()
    if path.suffix in (".yaml", ".yml") and (path.exists() or path.is_symlink()):
        return path  # read_yaml_file says what it is, where it is not a regular file
    candidate = RECIPES_DIR / f"{name}.yaml"
    if candidate.is_file():
        return candidate
    raise UserError(f"unknown recipe {name!r}; available recipes: {', '.join(available_recipes())} (or pass a YAML path)")


def parse_set(items: list[str]) -> dict:
    """`--set key=value` pairs; values are parsed as YAML (numbers, booleans, lists, null)."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UserError(f"--set expects key=value, got {item!r}")
        out[key.strip()] = parse_yaml(value, f"--set {key.strip()}") if value.strip() else None
    _check_keys(out, "--set")
    return out


def _coerce(raw: dict) -> dict:
    """Give YAML-loaded values the field's type where that is unambiguous (1e-4 is a str in YAML 1.1)."""
    types = {f.name: f.type for f in dataclasses.fields(Recipe)}
    out = {}
    for key, value in raw.items():
        t = str(types[key])
        try:
            if t == "float" and isinstance(value, (str, int)) and not isinstance(value, bool):
                value = float(value)
            elif t == "int" and isinstance(value, str):
                value = int(value)
            elif t == "bool" and isinstance(value, str):
                value = {"true": True, "false": False}[value.lower()]
        except (ValueError, KeyError):
            raise UserError(f"recipe key {key} expects {t}, got {value!r}") from None
        if t == "int" and isinstance(value, float) and value.is_integer():
            value = int(value)
        if t == "int" and (isinstance(value, bool) or not isinstance(value, int)):
            raise UserError(f"recipe key {key} expects a whole number, got {value!r}")
        if t == "float" and (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)):
            raise UserError(f"recipe key {key} expects a finite number, got {value!r}")
        if t == "bool" and not isinstance(value, bool):
            raise UserError(f"recipe key {key} expects true/false, got {value!r}")
        expected = {"list": list, "dict": dict, "str": str}.get(t)
        if expected is not None and not isinstance(value, expected):
            raise UserError(f"recipe key {key} expects a {t}, got {value!r}")
        if t == "int | None" and value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise UserError(f"recipe key {key} expects a whole number (or null), got {value!r}")
        if t == "bool | str":  # compile
            value = {"true": True, "false": False}.get(value.lower(), value) if isinstance(value, str) else value
            if not (isinstance(value, bool) or value == "captured"):
                raise UserError(f"recipe key {key} expects true, false or captured, got {value!r}")
        if t == "str | None" and value is not None and not isinstance(value, str):
            raise UserError(f"recipe key {key} expects a string (or null), got {value!r}")
        out[key] = value
    return out


def load_recipe(name: str | None = None, *, config_file: str | Path | None = None, overrides: dict | None = None) -> Recipe:
    """Recipe `name` (or defaults), then a YAML file, then overrides; validated."""
    raw: dict[str, Any] = {}
    if name:
        raw.update(_read_yaml(recipe_path(name)))
    if config_file:
        path = Path(config_file).expanduser()
        try:  # missing, a directory, a FIFO, a device, too large or not UTF-8: one line naming which
            read_text(path, "a YAML file of recipe keys")
        except UserError as exc:
            raise UserError(f"--config {exc}") from None
        raw.update(_read_yaml(path))
    if overrides:
        _check_keys(overrides, "overrides")
        raw.update(overrides)
    return Recipe(**_coerce(raw)).validate()
