"""One optimiser step: the micro-batches to the recipe's token batch, the objective, the update.

Every micro-batch's loss is divided by the global number of loss tokens (summed over processes
before the first forward), so the gradient is the whole token batch's however it is split into
micro-batches and processes. A non-finite loss or gradient norm stops the run before
the weights change, so the last checkpoint stays the last good state.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from melt_eval.errors import UserError
from melt_eval.training.config import Recipe
from melt_eval.training.data import DataStream, bucket, prompt_length
from melt_eval.training.losses import exit_gate_objective, objective


class NonFiniteLoss(UserError):
    """The loss or gradient norm stopped being finite; the weights were not updated."""


@dataclass
class Trainee:
    """What a step works on, set up once per run (build.prepare_training)."""

    accelerator: object
    model: torch.nn.Module  # as prepared by Accelerate (DDP/FSDP-wrapped where it applies)
    optimizer: torch.optim.Optimizer
    teacher: torch.nn.Module | None
    stream: DataStream
    recipe: Recipe
    world: int
    accum: int  # micro-batches per optimiser step on each process
    pad_id: int
    pad_multiple: int
    learned_gate: bool
    student_is_teacher: bool = False  # converted from the teacher in this run: equal functions at alpha = 0


@contextlib.contextmanager
def weight_casts_kept():
    """One micro-batch's forward and backward share autocast's casts of the weights.

    Autocast caches each weight's bf16 copy only until its outermost region exits: the student's forward
    exits its region, and activation checkpointing re-enters one per recomputed (layer, loop) step, so every
    recompute cast every weight again (a kernel per weight per step on the GPU). Holding the nesting count up
    over forward and backward keeps the forward's copies (the same values) until the backward ends, without
    turning autocast on for the backward itself; the gradients are unchanged."""
    torch.autocast_increment_nesting()
    try:
        yield
    finally:
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()


def lr_factor(step: int, recipe: Recipe) -> float:
    """Linear warmup over `warmup_steps`, then cosine decay to `min_lr_ratio` at `lr_schedule_steps`
    (default `max_steps`; it stays there after)."""
    if recipe.warmup_steps and step < recipe.warmup_steps:
        return (step + 1) / recipe.warmup_steps
    span = max(1, (recipe.lr_schedule_steps or recipe.max_steps) - recipe.warmup_steps)
    progress = min(1.0, (step - recipe.warmup_steps) / span)
    return recipe.min_lr_ratio + (1 - recipe.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def forward_objective(model, teacher, batch: dict, recipe: Recipe, step: int, *, n_loss_tokens: float, n_tokens: float,
                      output_loop_states: bool | None = None, teacher_autocast=contextlib.nullcontext, micro: int = 0):
    """One micro-batch through student (and teacher) and the recipe's objective at optimiser step `step`.

    Returns (LossTerms, student output). The student runs chunk-wise at the step's alpha; the
    teacher (the LoopLM, so chunking does not matter for it) runs without gradients. Neither
    builds [B, L, V] logits: the objective computes them a block of loss rows at a time. With exit_aware_p > 0
    the student's reply tokens leave their shared entries at drawn loops (`exit_loops`; `micro`, the micro-batch's
    index in the step, seeds the draw with the recipe's seed and the step, so a resumed run draws the same).
    """
    if recipe.target == "exit_gate":
        return _exit_gate_objective(model, batch, recipe, step, n_loss_tokens, micro)
    if output_loop_states is None:
        output_loop_states = recipe.needs_loop_states()
    ids, attn = batch["input_ids"], batch["attention_mask"]
    align = recipe.align_beta > 0
    teacher_out = None
    if teacher is not None and (recipe.kd or align):
        with torch.no_grad(), teacher_autocast():
            teacher_out = teacher(ids, attention_mask=attn, output_loop_states=recipe.kd, output_attn_outputs=align,
                                  compute_logits=False)

    def loss_fn(student_head, out):  # runs inside the student's forward (FSDP-gathered weights, autocast)
        return objective(out, teacher_out, ids, batch["loss_mask"], attn, kd=recipe.kd and teacher_out is not None,
                         student_head=student_head, teacher_head=teacher.lm_head if teacher is not None else None,
                         kd_beta=recipe.kd_beta, kd_temperature=recipe.kd_temperature, ce_weight=recipe.ce_weight,
                         loop_weights=recipe.loop_ce_weights,
                         align_beta=recipe.align_beta if teacher_out is not None else 0.0,
                         n_loss_tokens=n_loss_tokens, n_tokens=n_tokens)

    inner = getattr(model, "module", model)  # DDP/FSDP wrap it
    chunk_size, first_chunk = chunks(recipe, batch, inner.cache_layout())
    exits = exit_loops(recipe, batch["loss_mask"], inner, (recipe.seed, step, micro))
    out = model(ids, attention_mask=attn, chunk_size=chunk_size, first_chunk=first_chunk, alpha=recipe.alpha(step),
                output_loop_states=output_loop_states, output_attn_outputs=align, compute_logits=False, loss_fn=loss_fn,
                exit_loops=exits)
    return out.loss_terms, out


def _exit_gate_objective(model, batch: dict, recipe: Recipe, step: int, n_loss_tokens: float, micro: int):
    """target exit_gate: the model's own forward (for MELT its chunks and shared cache, by the recipe's chunk rule,
    so the gate sees the states MELT decodes with), every loop's state, Ouro's stage-II objective on the gate.
    Every weight but the gate's is frozen, so the forward itself records no graph. With exit_aware_p > 0 (MELT)
    earlier reply tokens leave their entries at drawn loops, so the labels come from the cache an exit leaves."""
    from melt_eval.modeling.early_exit import exit_logit

    inner = getattr(model, "module", model)  # DDP/FSDP wrap it
    ids = batch["input_ids"]

    def loss_fn(head, out):  # inside the forward, as the other objectives (FSDP-gathered weights, autocast)
        return exit_gate_objective(out, ids, batch["loss_mask"], head=head, gate_logit=lambda h: exit_logit(inner, h),
                                   k=recipe.exit_gate_k, gamma=recipe.exit_gate_gamma, n_loss_tokens=n_loss_tokens)

    chunk_size, first_chunk = chunks(recipe, batch, inner.cache_layout())
    exits = exit_loops(recipe, batch["loss_mask"], inner, (recipe.seed, step, micro))
    out = model(ids, attention_mask=batch["attention_mask"], chunk_size=chunk_size, first_chunk=first_chunk,
                output_loop_states=True, output_attn_outputs=False, compute_logits=False, loss_fn=loss_fn,
                exit_loops=exits)
    return out.loss_terms, out


def exit_loops(recipe: Recipe, loss_mask, model, seed: tuple[int, int, int]):
    """Exit-aware training's draw (docs/training.md#exit-aware-fine-tuning): [B, L] long, the loop each token's
    shared entry is left at. Reply tokens (loss_mask) stop early with probability exit_aware_p, at a loop drawn
    uniformly from exit_aware_loops ([]: 1..T-1); the prompt and the rest keep all T loops, as generation
    prefills the prompt at full depth. None when exit_aware_p is 0 (today's forward)."""
    if not recipe.exit_aware_p:
        return None
    if model.cache_layout().kind != "shared":
        raise UserError(f"exit_aware_p needs a model with a shared cache (MELT); this {model.config.model_type} "
                        "checkpoint keeps another: set exit_aware_p: 0")
    loops = model.config.total_ut_steps
    choices = recipe.exit_aware_loops or list(range(1, loops))
    if max(choices, default=0) >= loops or not choices:
        raise UserError(f"exit_aware_loops must be loops before the model's last (T = {loops}): 1..{loops - 1}; "
                        f"got {recipe.exit_aware_loops}")
    recipe_seed, step, micro = seed
    g = torch.Generator().manual_seed((recipe_seed * 1_000_003 + step) * 1_009 + micro)
    shape = tuple(loss_mask.shape)
    early = (torch.rand(shape, generator=g) < recipe.exit_aware_p) & loss_mask.bool().cpu()
    drawn = torch.tensor(choices)[torch.randint(len(choices), shape, generator=g)]
    return torch.where(early, drawn, torch.full(shape, loops)).to(loss_mask.device)


def chunks(recipe: Recipe, batch: dict, layout) -> tuple[int | None, int]:
    """(chunk size, first chunk) of the student's forward, whose cache is `layout` (a CacheLayout)."""
    if not layout.prefill_chunk_matters:
        return None, 0  # e.g. a LoopLM's per-loop cache: chunking changes nothing, one parallel pass
    if not recipe.chunk_size:
        return batch["input_ids"].shape[1], 0  # 0 = C = L, fully parallel
    return recipe.chunk_size, prompt_length(batch["loss_mask"]) if recipe.prompt_as_one_chunk else 0


def train_step(t: Trainee, step: int, tokens_seen: int, last_good: Path | None) -> dict:
    """Optimiser step `step` (0-based); returns its metrics record, whose "step" is `step + 1`."""
    t0 = time.perf_counter()
    recipe, accelerator = t.recipe, t.accelerator
    alpha = recipe.alpha(step)
    factor = lr_factor(step, recipe)
    for group in t.optimizer.param_groups:
        group["lr"] = group["base_lr"] * factor
    batches = bucket([t.stream.next() for _ in range(recipe.micro_batch_size * t.accum)], recipe.micro_batch_size,
                     t.pad_id, t.pad_multiple)
    counts = torch.tensor([sum(float(b["loss_mask"][:, 1:].sum()) for b in batches),
                           sum(float(b["attention_mask"].sum()) for b in batches),
                           sum(b["attention_mask"].numel() for b in batches)], device=accelerator.device)
    n_loss, n_tok, n_slots = accelerator.reduce(counts, reduction="sum").tolist()
    if exactly_zero(t, step):
        # The exact loss and gradient are 0; the computed ones are the rounding of two float paths (chunk-wise
        # student, parallel teacher), about 1e-9, which AdamW, blind to scale, would turn into a full
        # learning-rate step in every weight. The step keeps its batch, so the data that follows is unchanged.
        parts, gate_means, grad_norm = {"loss": 0.0, "kd": 0.0, **({"align": 0.0} if recipe.align_beta else {})}, None, 0.0
    else:
        parts, gate_means = _accumulate(t, batches, step, n_loss, n_tok)
        grad_norm = _update(t, step, parts, last_good)
    tokens_seen += int(n_tok)
    dt = time.perf_counter() - t0
    record = {"step": step + 1, **parts, "alpha": alpha, "grad_norm": grad_norm, "tokens": int(n_tok),
              "padding_fraction": 1.0 - n_tok / max(n_slots, 1.0),
              "overlong_truncated": t.stream.truncated, "overlong_dropped": t.stream.dropped,
              "tokens_seen": tokens_seen, "tokens_per_s": n_tok / dt, "step_time_s": dt}
    for group in t.optimizer.param_groups:
        record[f"lr.{group['name']}"] = group["lr"]
    if gate_means is not None:
        record[GATE_MEANS] = gate_means  # on the device; `read_gate_means` reads it when the step is logged
    return record


def exactly_zero(t: Trainee, step: int) -> bool:
    """Whether step `step`'s objective is 0 by construction: phase 1's first step (alpha = 0), where the student is
    the teacher it was converted from (no update yet) and the objective only compares it with that teacher (KD,
    alignment; no cross-entropy term). Such a step changes no weight (docs/training.md#the-first-step)."""
    recipe = t.recipe
    return (t.student_is_teacher and recipe.target == "melt" and recipe.interpolation_steps > 0
            and recipe.alpha(step) == 0.0 and recipe.kd and not recipe.ce_weight and not recipe.exit_aware_p)


GATE_MEANS = "gate_means_on_device"


def read_gate_means(record: dict) -> dict:
    """The record with its device-side gate means [N, T] turned into the logged `gate_mean` (per layer, loop 1
    None) and `gate_mean_all`: one host sync, on logging steps only (reading them every step stalled the GPU)."""
    gate_means = record.pop(GATE_MEANS, None)
    if gate_means is None:
        return record
    rows = gate_means.tolist()
    record["gate_mean"] = {f"layer{i}": [None if math.isnan(v) else round(v, 5) for v in row] for i, row in enumerate(rows)}
    valid = [v for row in rows for v in row if not math.isnan(v)]
    record["gate_mean_all"] = sum(valid) / len(valid) if valid else float("nan")
    return record


def _accumulate(t: Trainee, batches: list[dict], step: int, n_loss: float, n_tok: float):
    """Forward and backward every micro-batch; returns the loss parts summed over all processes and
    the last gate means the student reported (None if it reported none)."""
    accelerator, recipe = t.accelerator, t.recipe
    want_states = recipe.needs_loop_states() or (t.learned_gate and step % recipe.log_every == 0)
    parts: dict[str, float] = {}
    gate_means = None
    for i, batch in enumerate(batches):
        batch = {k: v.to(accelerator.device) for k, v in batch.items()}
        sync = contextlib.nullcontext() if i == t.accum - 1 else accelerator.no_sync(t.model)
        with sync, weight_casts_kept():
            terms, out = forward_objective(t.model, t.teacher, batch, recipe, step, n_loss_tokens=n_loss,
                                           n_tokens=n_tok, output_loop_states=want_states,
                                           teacher_autocast=accelerator.autocast, micro=i)
            # every process divided by the global token count; DDP averages gradients over processes
            accelerator.backward(terms.total * t.world)
        for k, v in terms.parts.items():
            parts[k] = parts.get(k, 0.0) + v
        parts["loss"] = parts.get("loss", 0.0) + float(terms.total.detach())
        if getattr(out, "gate_means", None) is not None:
            gate_means = out.gate_means
        del out, terms
    reduced = accelerator.reduce(torch.tensor([parts[k] for k in sorted(parts)], device=accelerator.device), reduction="sum")
    return dict(zip(sorted(parts), reduced.tolist())), gate_means


def _update(t: Trainee, step: int, parts: dict, last_good: Path | None) -> float:
    """Clip and apply the accumulated gradients unless the loss or their norm is not finite; the norm."""
    if not math.isfinite(parts["loss"]):
        _stop_nonfinite("loss", step, parts, last_good, t.optimizer)
    grad_norm = float(t.accelerator.clip_grad_norm_(t.model.parameters(), t.recipe.grad_clip))
    if not math.isfinite(grad_norm):
        _stop_nonfinite("gradient norm", step, parts, last_good, t.optimizer)
    t.optimizer.step()
    t.optimizer.zero_grad(set_to_none=True)
    return grad_norm


def _stop_nonfinite(what: str, step: int, parts: dict, last_good: Path | None, optimizer) -> None:
    optimizer.zero_grad(set_to_none=True)
    terms = ", ".join(f"{k}={v:.4g}" for k, v in sorted(parts.items()))
    where = f"the last good checkpoint is {last_good}; continue from it with --resume" if last_good else "no checkpoint was written yet"
    raise NonFiniteLoss(
        f"non-finite {what} at step {step + 1} ({terms}); stopped before updating the weights; {where} "
        "(lower lr/gate_lr or check the data)"
    )
