"""Kernel ops per phase-1 training step, counted exactly on the CPU (benchmarks/dispatch.py, issue 49).

On a GPU the chunk-wise step is bound by the host's dispatch of small ops: each op is a launch. Op
counts are exact and deterministic, so these are budgets, not timings. Counted at N = 1 and 2 layers
and extrapolated to the paper's N = 24 (counts are linear in N; the benchmark checks it against a direct
count).
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import dispatch  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

# What the step reaches now (docs/results/2026-11-29-dispatch.md); before issue 49: 362.78 per (chunk, layer,
# loop), 8,826 fixed per step, compiled 160.78. Issue 49's aims: <= 200, <= 2,000 and <= 60. An op more fails.
EAGER_PER_UNIT = 229.29
FIXED_PER_STEP = 4578
COMPILED_PER_UNIT = 56.19
# compile: captured, the whole (layer, loop) step one graph forward and one for its recompute and backward: on
# CUDA each is one graph replay
CAPTURED_PER_UNIT = 51.27
# With F.rms_norm counted as the one fused kernel each way that CUDA launches (the CPU's is a composite):
# what a GPU issues. Both meet the aims.
NORMS_FUSED_PER_UNIT = 134.38
NORMS_FUSED_FIXED = 1862


@pytest.fixture(scope="module")
def eager():
    return dispatch.train_section(24, compiled=False, count_layers=(1, 2))


def test_eager_ops_per_chunk_layer_loop_stay_within_budget(eager):
    unit = eager["per_chunk_layer_loop"]
    assert round(unit["total"], 2) <= EAGER_PER_UNIT, unit
    assert unit["total"] == pytest.approx(unit["forward"] + unit["recompute"] + unit["backward"])
    assert unit["recompute"] > 0  # activation checkpointing re-runs the step: the recompute is counted apart


def test_fixed_ops_per_step_stay_within_budget(eager):
    fixed = eager["fixed_per_step"]
    assert round(fixed["total"]) <= FIXED_PER_STEP, fixed
    assert fixed["by_phase"]["teacher"] > 0 and fixed["by_phase"]["optimizer"] > 0


def test_with_norms_fused_as_on_cuda_the_step_meets_the_200_and_2000_op_aims():
    section = dispatch.train_section(24, compiled=False, count_layers=(1, 2), fused_norms=True)
    unit, fixed = section["per_chunk_layer_loop"], section["fixed_per_step"]
    assert round(unit["total"], 2) <= NORMS_FUSED_PER_UNIT <= 200, unit
    assert round(fixed["total"]) <= NORMS_FUSED_FIXED <= 2000, fixed


def test_the_fused_norm_stand_in_computes_what_rms_norm_computes():
    """The counted step must be the same computation: `FusedNorm` gives F.rms_norm's outputs and gradients, bit for
    bit, with and without a weight, in fp32 and under bf16 autocast (a bf16 input and an fp32 weight)."""
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    for dtype, weighted, autocast in ((torch.float32, True, False), (torch.float32, False, False),
                                      (torch.bfloat16, False, True), (torch.float32, True, True)):
        x = torch.randn(3, 5, 16, generator=g).to(dtype).requires_grad_()
        w = torch.randn(16, generator=g).requires_grad_() if weighted else None
        counter = dispatch.OpCounter()
        results = []
        for fused in (False, True):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                with dispatch.norms_fused(counter) if fused else dispatch.contextlib.nullcontext():
                    y = F.rms_norm(x, (16,), w, 1e-6)
            grads = torch.autograd.grad((y.float() ** 2).sum(), [x] + ([w] if weighted else []))
            results.append((y, grads))
        (y0, g0), (y1, g1) = results
        assert torch.equal(y0, y1) and y0.dtype == y1.dtype
        assert all(torch.equal(a, b) for a, b in zip(g0, g1))
        assert counter.counts[("other", "rms_norm (fused)")] == 1
        assert counter.counts[("backward", "rms_norm_backward (fused)")] == 1
    assert F.rms_norm is dispatch.FusedNorm.composite  # restored


@pytest.mark.slow
def test_the_compiled_step_launches_fewer_ops_and_compiles_once_across_chunks():
    section = dispatch.train_section(24, compiled=True, count_layers=(1, 2))
    assert round(section["per_chunk_layer_loop"]["total"], 2) <= COMPILED_PER_UNIT <= 60, section["per_chunk_layer_loop"]
    assert section["dynamo"]["warm-up"]["unique_graphs"] > 0  # really compiled
    assert section["dynamo"]["warm-up"]["graph_breaks"] == 0
    assert section["dynamo"]["counted_steps"]["unique_graphs"] == 0  # no recompile at a chunk index seen before


def test_keeping_weight_casts_over_the_backward_leaves_bf16_gradients_unchanged():
    """`weight_casts_kept` (the runner's micro-batch scope) saves the recompute's weight casts, not a bit of the
    gradients: fp32 weights under bf16 autocast, chunked, with activation checkpointing, as the runner trains."""
    import torch

    from melt_eval.training.runner import forward_objective
    from melt_eval.training.step import weight_casts_kept

    grads = []
    for keep in (False, True):
        student, teacher, recipe = dispatch.build(1)
        ids = torch.randint(0, dispatch.SHAPE["vocab_size"], (1, 3 * dispatch.CHUNK), generator=torch.Generator().manual_seed(0))
        ones = torch.ones_like(ids, dtype=torch.bool)
        batch = {"input_ids": ids, "attention_mask": ones, "loss_mask": ones}
        with weight_casts_kept() if keep else dispatch.contextlib.nullcontext():
            with dispatch.amp():
                terms, _ = forward_objective(student, teacher, batch, recipe, dispatch.PHASE1_STEP, n_loss_tokens=ids.numel(),
                                             n_tokens=ids.numel(), teacher_autocast=dispatch.amp)
            terms.total.backward()
        grads.append({n: p.grad for n, p in student.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 10
    for name, g in grads[0].items():
        assert torch.equal(grads[1][name], g), name


@pytest.mark.slow
def test_the_captured_step_is_two_whole_graphs_that_compile_once_across_chunks():
    """`compile_captured_step`: every (layer, loop) step, attention included, with fullgraph=True (a graph break
    would be an error); its recompute runs inside the backward's graph (nothing counts as a recompute)."""
    section = dispatch.train_section(24, compiled="captured", count_layers=(1, 2))
    unit = section["per_chunk_layer_loop"]
    assert round(unit["total"], 2) <= CAPTURED_PER_UNIT <= COMPILED_PER_UNIT, unit
    assert unit["recompute"] == 0 and unit["forward"] > 0 and unit["backward"] > 0
    assert section["dynamo"]["warm-up"]["unique_graphs"] > 0 and section["dynamo"]["warm-up"]["graph_breaks"] == 0
    assert section["dynamo"]["counted_steps"] == {"unique_graphs": 0, "graph_breaks": 0, "recompiles": 0}
