"""The paper's training ablations as recipe overrides (MELT.md "Component-removal ladder").

Each ladder variant is a phase-1 run, optionally followed by phase 2, with the overrides
below applied on top of the chosen recipes (paper-phase1/2 or tiny-phase1/2):

    full       phase 1 (chunk-wise + interpolated transition + all-loop KD) + phase 2 (KD + alignment)
    no-align   phase 1 only                                   ("- attention-aligned distillation")
    no-interp  phase 1 with alpha = 1 from step 0             ("- interpolated transition")
    no-kd      plain SFT, chunk-wise, no interpolation        ("- GKD-allLoops")
    no-chunk   plain SFT with C = L (fully parallel)          ("- chunk-wise training")

Gate ablations are phase-1 runs with another gate (the paper: "Gate ablations use phase 1 only").

    from melt_eval.training import ladder, run_recipe
    for phase, recipe, overrides in ladder.plan("no-interp", base="tiny"):
        ...  # run_recipe(recipe, from_model=..., output=..., overrides=overrides)
"""

from __future__ import annotations

# variant -> {"phase1": overrides, "phase2": overrides or None (no phase 2)}
LADDER: dict[str, dict] = {
    "full": {"phase1": {}, "phase2": {}},
    "no-align": {"phase1": {}, "phase2": None},
    "no-interp": {"phase1": {"interpolation_steps": 0}, "phase2": None},
    "no-kd": {"phase1": {"interpolation_steps": 0, "kd": False}, "phase2": None},
    "no-chunk": {"phase1": {"interpolation_steps": 0, "kd": False, "chunk_size": 0}, "phase2": None},
}

# the paper's gate ablation (phase 1 only) -> phase-1 overrides
GATE_VARIANTS: dict[str, dict] = {
    "elementwise": {"gate": "elementwise"},
    "scalar": {"gate": "scalar"},
    "ema-0.2": {"gate": "ema", "ema_decay": 0.2},
    "mean": {"gate": "mean"},
    "last": {"gate": "last"},
}


def plan(variant: str, base: str = "paper") -> list[tuple[int, str, dict]]:
    """[(phase, recipe name, overrides), ...] for a ladder or gate variant; base "paper" or "tiny".

    Phase 2 takes phase 1's output as --from (its teacher is recorded there).
    """
    if base not in ("paper", "tiny"):
        raise ValueError(f"base must be 'paper' or 'tiny', got {base!r}")
    if variant in LADDER:
        entry = LADDER[variant]
        steps = [(1, f"{base}-phase1", dict(entry["phase1"]))]
        if entry["phase2"] is not None:
            steps.append((2, f"{base}-phase2", dict(entry["phase2"])))
        return steps
    if variant in GATE_VARIANTS:
        return [(1, f"{base}-phase1", dict(GATE_VARIANTS[variant]))]
    raise ValueError(f"unknown variant {variant!r}; ladder: {', '.join(LADDER)}; gates: {', '.join(GATE_VARIANTS)}")
