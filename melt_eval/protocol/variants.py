"""Every ablation variant of the paper, defined once (docs/method.md#ablation-rows).

A variant is what training runs (overrides of the phase-1 and phase-2 recipes, or no training), how it
is evaluated (inference options), and the row of the paper's table it stands for (its key in
paper_results.json, the label the paper prints, and the run the paper reports twice that it may
borrow). `ablate` and the demo plan from these (`melt_eval.experiments.ablations`), the report labels
its rows and picks fallbacks from them (`melt_eval.report.paper`).

Component-removal ladder, on the chosen recipes (paper-phase1/2 or tiny-phase1/2):

    full       phase 1 (chunk-wise + interpolated transition + all-loop KD) + phase 2 (KD + alignment)
    no-align   phase 1 only                                   ("- attention-aligned distillation")
    no-interp  phase 1 with alpha = 1 from step 0             ("- interpolated transition")
    no-kd      plain SFT, chunk-wise, no interpolation        ("- GKD-allLoops")
    no-chunk   plain SFT with C = L (fully parallel)          ("- chunk-wise training")

Gate ablations are phase-1 runs with another gate (the paper: "Gate ablations use phase 1 only").
The KV-sharing variants are Ouro evaluated as is, reusing one loop's KV in every loop.

    from melt_eval.protocol.variants import training_steps
    for phase, recipe, overrides in training_steps("no-interp", base="tiny"):
        ...  # melt_eval.training.run_recipe(recipe, from_model=..., output=..., overrides=overrides)

This module imports nothing from the harness, so every layer can read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

@dataclass(frozen=True)
class Variant:
    ablation: str  # "gates" | "components" | "kv-sharing"
    name: str  # the results directory's name: results/ablations/<ablation>/<name>/
    paper_key: str  # its row in paper_results.json
    paper_label: str  # its row as the paper's table prints it
    phase1: dict | None = None  # overrides of <base>-phase1; None: evaluated as is, no training
    phase2: dict | None = None  # overrides of <base>-phase2; None: no phase 2
    eval_options: dict = field(default_factory=dict)  # run_tasks options (kv_sharing, share_prompt)
    # The same checkpoint in another table ((ablation or "main", variant or registry model)): a row with
    # no results of its own borrows them from there, and the table says so.
    fallback: tuple[str, str] | None = None
    # A recipe of its own instead of phase 1/2, trained from the model the row evaluates: `<recipe>` on the paper
    # recipes, `tiny-<recipe>` on the tiny ones, with `phase1` its overrides (the EXIT rows' fitted gate: exit-gate)
    recipe: str | None = None
    # recipes run one after another, each from the previous one's output (the EXIT rows' exit-aware chain:
    # exit-aware, then exit-gate); used instead of `recipe` when set
    chain: tuple[str, ...] = ()

    def training_steps(self, base: str = "paper") -> list[tuple[int, str, dict]]:
        """[(phase, recipe name, overrides), ...] on the "paper" or "tiny" recipes; [] when evaluated as is.

        Phase 2 takes phase 1's output as --from (its teacher is recorded there).
        """
        if base not in ("paper", "tiny"):
            raise ValueError(f"base must be 'paper' or 'tiny', got {base!r}")
        if self.recipe is not None or self.chain:
            names = self.chain or (self.recipe,)
            return [(i + 1, name if base == "paper" else f"{base}-{name}", dict(self.phase1 or {}) if i == 0 else {})
                    for i, name in enumerate(names)]
        if self.phase1 is None:
            return []

        def resolved(overrides: dict) -> dict:  # a PerBase override takes the base's value
            return {k: getattr(v, base) if isinstance(v, PerBase) else v for k, v in overrides.items()}

        steps = [(1, f"{base}-phase1", resolved(self.phase1))]
        if self.phase2 is not None:
            steps.append((2, f"{base}-phase2", resolved(self.phase2)))
        return steps


@dataclass(frozen=True)
class PerBase:
    """A training override that depends on the model's size (a head count): its value on the paper's recipes
    and on the tiny ones."""
    paper: object
    tiny: object


@dataclass(frozen=True)
class Ablation:
    name: str
    section: str  # its table in paper_results.json
    title: str
    stub: str  # the heading of the table's first column
    variants: tuple[Variant, ...]  # in the paper's row order


GATES = Ablation("gates", "gate_ablation_phase1", "Gate ablation (after phase 1)", "Model variant", (
    Variant("gates", "elementwise", "MELT-1.6B (P1, elementwise)", "MELT-1.6B (P1)", phase1={"gate": "elementwise"},
            fallback=("components", "no-align")),
    Variant("gates", "mean", "mean", "Mean", phase1={"gate": "mean"}),
    Variant("gates", "ema-0.2", "ema-0.2", "EMA-0.2", phase1={"gate": "ema", "ema_decay": 0.2}),
    Variant("gates", "last", "last", "Last", phase1={"gate": "last"}),
    Variant("gates", "scalar", "scalar (single-gated)", "Single-gated", phase1={"gate": "scalar"}),
))

COMPONENTS = Ablation("components", "component_removal", "Component removal", "Component removed", (
    Variant("components", "full", "MELT-1.6B (full)", "MELT-1.6B", phase1={}, phase2={},
            fallback=("main", "melt-1.6b")),
    Variant("components", "no-align", "- attention-aligned distillation", "- Att-aligned distillation", phase1={},
            fallback=("gates", "elementwise")),
    Variant("components", "no-interp", "- interpolated transition", "- Interpolated transition",
            phase1={"interpolation_steps": 0}),
    Variant("components", "no-kd", "- GKD-allLoops", "- GKD-allLoops", phase1={"interpolation_steps": 0, "kd": False}),
    Variant("components", "no-chunk", "- chunk-wise training", "- Chunk-wise training",
            phase1={"interpolation_steps": 0, "kd": False, "chunk_size": 0}),
))

# The untrained KV-sharing baselines (docs/method.md#untrained-sharing): which loop's KV every loop reuses, and
# whether the prompt keeps Ouro's per-loop cache ("w/ prefill") or shares it too.
KV_SHARING = Ablation("kv-sharing", "untrained_kv_sharing", "Untrained KV sharing on Ouro-1.4B-Thinking", "KV sharing", (
    Variant("kv-sharing", "ouro", "Ouro-1.4B-Thinking", "Ouro-1.4B-Thinking",
            eval_options={"kv_sharing": None, "share_prompt": False}, fallback=("main", "ouro-1.4b-thinking")),
    Variant("kv-sharing", "last-prefill", "last loop (w/ prefill)", "Last loop (w/ prefill)",
            eval_options={"kv_sharing": "last", "share_prompt": False}),
    Variant("kv-sharing", "last", "last loop", "Last loop", eval_options={"kv_sharing": "last", "share_prompt": True}),
    Variant("kv-sharing", "first-prefill", "first loop (w/ prefill)", "First loop (w/ prefill)",
            eval_options={"kv_sharing": "first", "share_prompt": False}),
    Variant("kv-sharing", "first", "first loop", "First loop", eval_options={"kv_sharing": "first", "share_prompt": True}),
))

ABLATIONS: dict[str, Ablation] = {a.name: a for a in (GATES, COMPONENTS, KV_SHARING)}

# Beyond the paper (docs/method.md#quantized-caches): what else reaches MELT's memory. Compressed caches of the
# teacher and of MELT (the components table's `full` run: trained once for both), evaluated as is. No paper
# numbers: `paper_key` is empty, and these rows are not among ABLATIONS (the paper's tables and checks).
_MELT = {"phase1": {}, "phase2": {}, "fallback": ("components", "full")}
KV_COMPRESSION = Ablation("kv-compression", "", "Beyond the paper: compressed KV caches", "KV cache", (
    Variant("kv-compression", "ouro", "", "Ouro", eval_options={}, fallback=("kv-sharing", "ouro")),
    Variant("kv-compression", "ouro-fp8", "", "Ouro, fp8 cache", eval_options={"kv_cache_dtype": "fp8"}),
    Variant("kv-compression", "ouro-int8", "", "Ouro, int8 cache", eval_options={"kv_cache_dtype": "int8"}),
    Variant("kv-compression", "ouro-int4", "", "Ouro, int4 cache", eval_options={"kv_cache_dtype": "int4"}),
    Variant("kv-compression", "ouro-cross-loop", "", "Ouro, cross-loop int4 deltas", eval_options={"cross_loop_kv": True}),
    Variant("kv-compression", "melt", "", "MELT", **_MELT),
    Variant("kv-compression", "melt-fp8", "", "MELT, fp8 cache", eval_options={"kv_cache_dtype": "fp8"}, **_MELT),
    Variant("kv-compression", "melt-int8", "", "MELT, int8 cache", eval_options={"kv_cache_dtype": "int8"}, **_MELT),
    Variant("kv-compression", "melt-int4", "", "MELT, int4 cache", eval_options={"kv_cache_dtype": "int4"}, **_MELT),
    # grouped-query MELT (the paper's future work): K/V heads mean-pooled into groups when converting, then both
    # phases as usual; Ouro-1.4B's 16 heads into 4, the tiny models' 2 into 1
    Variant("kv-compression", "melt-gqa", "", "GQA-MELT", phase1={"kv_heads": PerBase(paper=4, tiny=1)}, phase2={}),
))

# Run order of `ablate` and the demo (the paper's table order differs for the gates).
GATE_VARIANTS = ("elementwise", "scalar", "ema-0.2", "mean", "last")
LADDER = ("full", "no-align", "no-interp", "no-kd", "no-chunk")  # each row removes one more component
RUN_ORDER = {"gates": GATE_VARIANTS, "components": LADDER, "kv-sharing": tuple(v.name for v in KV_SHARING.variants),
             "kv-compression": tuple(v.name for v in KV_COMPRESSION.variants)}


def variant(ablation: str, name: str) -> Variant:
    return next(v for v in (ABLATIONS.get(ablation) or BEYOND_PAPER[ablation]).variants if v.name == name)


def training_steps(name: str, base: str = "paper") -> list[tuple[int, str, dict]]:
    """The training runs of a ladder or gate variant, by name (see Variant.training_steps)."""
    ablation = "components" if name in LADDER else "gates" if name in GATE_VARIANTS else None
    if ablation is None:
        raise ValueError(f"unknown variant {name!r}; ladder: {', '.join(LADDER)}; gates: {', '.join(GATE_VARIANTS)}")
    return variant(ablation, name).training_steps(base)


# Beyond the paper (docs/method.md#early-exit): early exit of generated tokens, a grid over Ouro's gate
# threshold q and the training-free agreement count k, with full depth as the reference point. Not one
# of the paper's tables (it has none for early exit), so not in ABLATIONS: the demo and the paper's
# tables do not plan it; `melt-eval ablate exit` evaluates each of the preset's models (Ouro and MELT)
# as is at every point. paper_key is empty: no paper figure to compare with.
EXIT_THRESHOLDS = (0.5, 0.7, 0.9, 0.95, 0.99)
EXIT_AGREEMENTS = (1, 2, 3)
FITTED_GATE = "fitted-gate"  # the name prefix of the rows on a fitted gate (the report draws them as their own series)
# MELT only: the model fine-tuned exit-aware, then its gate fitted (docs/method.md#exit-aware-fine-tuning); the
# name prefix of those rows (their own series), planned for a MELT that records its teacher (ablations.exit_plan)
EXIT_AWARE = "exit-aware"
EXIT_AWARE_THRESHOLDS = (0.7, 0.8, 0.9)
EXIT = Ablation("exit", "", "Early exit: accuracy against loops per token (beyond the paper)", "Exit rule", (
    Variant("exit", "full", "", "All loops", eval_options={"exit": None}),
    *(Variant("exit", f"gate-{q:g}", "", f"Gate q = {q:g}", eval_options={"exit": f"gate:{q:g}"})
      for q in EXIT_THRESHOLDS),
    *(Variant("exit", f"agree-{k}", "", f"Agree k = {k}", eval_options={"exit": f"agree:{k}"})
      for k in EXIT_AGREEMENTS),
    # the same thresholds on the gate fitted to the model's own loop states (recipe exit-gate, Ouro's stage II),
    # one fit per model shared by these rows; the other rows use the checkpoint's gate (MELT's is its teacher's)
    *(Variant("exit", f"{FITTED_GATE}-{q:g}", "", f"Fitted gate q = {q:g}", recipe="exit-gate",
              eval_options={"exit": f"gate:{q:g}"}) for q in EXIT_THRESHOLDS),
    Variant("exit", f"{EXIT_AWARE}-full", "", "Exit-aware, all loops", chain=("exit-aware", "exit-gate"),
            eval_options={"exit": None}),
    *(Variant("exit", f"{EXIT_AWARE}-{q:g}", "", f"Exit-aware, fitted gate q = {q:g}", chain=("exit-aware", "exit-gate"),
              eval_options={"exit": f"gate:{q:g}"}) for q in EXIT_AWARE_THRESHOLDS),
))
BEYOND_PAPER: dict[str, Ablation] = {KV_COMPRESSION.name: KV_COMPRESSION, EXIT.name: EXIT}
RUN_ORDER[EXIT.name] = tuple(v.name for v in EXIT.variants)
