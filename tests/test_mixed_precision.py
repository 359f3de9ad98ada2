"""bf16 training as a GPU runs it, proven on the CPU (autocast "cpu" takes the same code path as "cuda").

Two set-ups, both what users run: fp32 weights under bf16 autocast (the single-GPU runner:
Accelerate's `mixed_precision="bf16"`, the teacher cast to bf16) and all-bf16 weights.
"""

import copy

import pytest
import torch

from melt_eval.modeling import MeltForCausalLM
from melt_eval.modeling.looplm import rope_inv_freq
from melt_eval.training import load_recipe
from melt_eval.training.runner import forward_objective, param_groups

pytestmark = pytest.mark.usefixtures("one_thread")

L = 24  # C = 5 leaves a ragged last chunk
BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def looplm():
    """A tiny LoopLM at the usual 0.02 init scale: bf16 rounding then matters as it does at full size."""
    from melt_eval.modeling.tiny import build_tokenizer, make_tiny_looplm

    torch.manual_seed(0)
    return make_tiny_looplm(build_tokenizer(), num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=16, hidden_size=64, intermediate_size=96, loops=3).eval()


@pytest.fixture(scope="module")
def batch(training_batch):
    return training_batch(L, pad_from=20, loss_from=(6, 4))


def autocast():
    return torch.autocast("cpu", dtype=BF16)


def recipe_for(phase: int):
    """Phase 1 mid-transition (alpha 0.5: both KV sets) or phase 2 (alpha 1 with attention alignment), C = 5."""
    if phase == 1:
        return load_recipe("tiny-phase1", overrides={"chunk_size": 5, "interpolation_steps": 10,
                                                     "prompt_as_one_chunk": False, "gradient_checkpointing": True}), 5
    return load_recipe("tiny-phase2", overrides={"chunk_size": 5, "align_beta": 0.1, "prompt_as_one_chunk": False,
                                                 "gradient_checkpointing": True}), 0


def counts(batch) -> dict:
    return dict(n_loss_tokens=float(batch["loss_mask"][:, 1:].sum()), n_tokens=float(batch["attention_mask"].sum()))


def student_and_teacher(looplm, weights_dtype):
    teacher = copy.deepcopy(looplm).to(BF16).requires_grad_(False)  # as the runner casts it under bf16
    student = MeltForCausalLM.from_looplm(looplm, gate="elementwise", seed=1).train().to(weights_dtype)
    student.model.early_exit_gate.requires_grad_(False)
    student.gradient_checkpointing_enable()
    return student, teacher


def step(student, teacher, batch, recipe, at_step):
    with autocast():
        terms, out = forward_objective(student, teacher, batch, recipe, at_step, teacher_autocast=autocast, **counts(batch))
    terms.total.backward()
    return terms, out


@pytest.mark.parametrize("weights_dtype", [torch.float32, BF16], ids=["fp32-weights-autocast", "bf16-weights"])
@pytest.mark.parametrize("phase", [1, 2])
def test_a_chunked_training_step_runs_in_bf16(looplm, batch, phase, weights_dtype):
    recipe, at_step = recipe_for(phase)
    assert 0 < recipe.alpha(at_step) < 1 if phase == 1 else recipe.alpha(at_step) == 1 and recipe.align_beta > 0
    student, teacher = student_and_teacher(looplm, weights_dtype)
    terms, _ = step(student, teacher, batch, recipe, at_step)
    assert torch.isfinite(terms.total) and terms.total > 0
    assert set(terms.parts) >= ({"kd", "align"} if phase == 2 else {"kd"})
    grads = {n: p.grad for n, p in student.named_parameters() if p.requires_grad}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values()), [n for n, g in grads.items() if g is None]
    assert all(g.dtype == weights_dtype for g in grads.values())
    assert sum(float(g.float().abs().sum()) for g in grads.values()) > 0


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow),
                                      pytest.param("captured", marks=pytest.mark.slow)], ids=["eager", "compiled", "captured"])
@pytest.mark.parametrize("phase", [1, 2])
def test_bf16_gradients_agree_with_fp32_per_parameter_group(looplm, batch, phase, compiled):
    """One micro-batch: the gradient of each optimiser group under bf16 autocast points where fp32's does, for the
    eager step, for the compiled one (`compile: true`: bf16 copies of the matrix weights, gradients added
    into .grad inside the compiled backward) and for the captured one (`compile: captured`: the whole step, its
    recompute and backward under vjp in one graph, the forward's autocast re-entered for the recompute)."""
    recipe, at_step = recipe_for(phase)
    results = {}
    for precision in ("fp32", "bf16"):
        student, teacher = student_and_teacher(looplm, torch.float32)
        if precision == "fp32":
            teacher = copy.deepcopy(looplm).requires_grad_(False)
            terms, _ = forward_objective(student, teacher, batch, recipe, at_step, **counts(batch))
            terms.total.backward()
        else:
            if compiled:
                torch._dynamo.reset()  # graphs of other tests' models count toward the recompile limit
                if compiled == "captured":
                    student.model.compile_captured_step()
                else:
                    student.model.compile_layer_step()
            step(student, teacher, batch, recipe, at_step)
        results[precision] = {g["name"]: torch.cat([p.grad.flatten() for p in g["params"]]) for g in param_groups(student, recipe)}
    assert set(results["fp32"]) == {"base", "gate"}
    for name, want in results["fp32"].items():
        cosine = float(torch.nn.functional.cosine_similarity(results["bf16"][name].double(), want.double(), dim=0))
        assert cosine > 0.999, f"{name}: cosine {cosine:.5f}"


def test_at_alpha_0_the_kd_loss_against_the_teacher_is_zero_in_bf16(looplm, batch):
    """alpha = 0 is the LoopLM exactly, whatever the chunks: bf16 leaves only rounding (the student
    runs fp32 weights under autocast in chunks of 5, the teacher bf16 weights in one pass)."""
    recipe, _ = recipe_for(1)
    kd = {}
    for at_step in (0, 10):  # alpha 0, and alpha 1 with untrained gates (what "far from zero" looks like)
        student, teacher = student_and_teacher(looplm, torch.float32)
        with torch.no_grad(), autocast():
            terms, _ = forward_objective(student, teacher, batch, recipe, at_step, teacher_autocast=autocast, **counts(batch))
        kd[recipe.alpha(at_step)] = terms.parts["kd"]
    assert kd[0.0] < 1e-3, kd
    assert kd[1.0] > 100 * max(kd[0.0], 1e-6), kd


def test_training_rope_equals_inference_rope(looplm, tmp_path):
    """Casting to bf16 (`.to`, or FSDP's buffer cast through `.data`) keeps RoPE's frequencies fp32,
    so the positions a model trains at are the ones the engine (fp32 frequencies) decodes at."""
    from melt_eval.modeling import load_model

    exact = rope_inv_freq(looplm.config)
    cast = copy.deepcopy(looplm).to(BF16)  # the runner's teacher
    fsdp_like = copy.deepcopy(looplm)
    buf = fsdp_like.model.rotary_emb.inv_freq
    buf.data = buf.data.to(BF16)  # FSDP MixedPrecision(buffer_dtype=bf16) assigns .data, bypassing Module._apply
    from melt_eval.modeling.tiny import build_tokenizer

    looplm.save_pretrained(tmp_path)
    build_tokenizer().save_pretrained(tmp_path)
    loaded, _ = load_model(tmp_path, dtype=BF16)  # what `melt-eval run --dtype bfloat16` decodes with
    positions = torch.tensor([[0, 1, 777, 10_000, 32_767]])
    want_cos, want_sin = looplm.model.rotary_emb(positions, BF16)
    for name, model in (("cast", cast), ("fsdp-like", fsdp_like), ("loaded", loaded)):
        rope = model.model.rotary_emb
        assert torch.equal(rope.fp32_inv_freq(), exact), name
        cos, sin = rope(positions, BF16)
        assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin), name
    assert cast.model.rotary_emb.inv_freq.dtype == torch.float32
    # what the fix prevents: bf16-rounded frequencies put distant positions elsewhere
    rounded = exact.to(BF16).float()
    phase_error = ((rounded - exact) * 10_000).abs().max()
    assert phase_error > 0.1


def test_a_second_backward_through_chunked_training_is_refused(looplm, batch):
    """The KV store is not part of the graph (checkpointing rewrites it while recomputing): a second
    backward would give wrong gradients silently, so it stops with a message instead."""
    recipe, at_step = recipe_for(1)
    student, teacher = student_and_teacher(looplm, torch.float32)
    terms, _ = forward_objective(student, teacher.float(), batch, recipe, at_step, **counts(batch))
    terms.total.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        terms.total.backward()


def test_double_backward_through_chunked_attention_is_refused(looplm, batch):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    student = MeltForCausalLM.from_looplm(looplm.float(), gate="elementwise", seed=1).train()
    with sdpa_kernel(SDPBackend.MATH):  # twice differentiable, so only the chunk store can refuse
        out = student(batch["input_ids"], chunk_size=5)
        g = torch.autograd.grad(out.logits.pow(2).sum(), student.model.layers[0].melt_gate.bias, create_graph=True)[0]
        with pytest.raises(RuntimeError, match="once_differentiable"):
            g.sum().backward()


def test_an_exception_mid_forward_frees_the_kv_buffers(looplm, batch, monkeypatch):
    import gc
    import weakref

    from melt_eval.modeling import kv_cache

    student = MeltForCausalLM.from_looplm(looplm.float(), gate="elementwise", seed=1).train()
    stores, calls = [], {"n": 0}
    real_init, real_commit = kv_cache.TrainingKVBuffer.__init__, kv_cache.TrainingKVBuffer.commit

    def tracked(self, capacity):
        real_init(self, capacity)
        stores.append(weakref.ref(self))

    def failing_commit(self, finals, c):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt  # what Ctrl-C mid-step raises
        return real_commit(self, finals, c)

    monkeypatch.setattr(kv_cache.TrainingKVBuffer, "__init__", tracked)
    monkeypatch.setattr(kv_cache.TrainingKVBuffer, "commit", failing_commit)
    with pytest.raises(KeyboardInterrupt):
        student(batch["input_ids"], chunk_size=5)
    gc.collect()
    assert stores and all(ref() is None for ref in stores)



@pytest.fixture
def fresh_accelerate_state():
    """Accelerate keeps its mixed-precision choice per process: earlier tests in this process chose "no"."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def test_the_runner_trains_chunked_melt_with_bf16_mixed_precision(tmp_path, fresh_accelerate_state):
    """The single-GPU runner's set-up (Accelerate bf16 autocast, fp32 student, bf16 teacher) end to end."""
    import json

    from melt_eval.training import run_recipe

    out = run_recipe("tiny-phase1", "tiny-random-ouro", tmp_path / "bf16", progress=False, overrides={
        "mixed_precision": "bf16", "chunk_size": 4, "prompt_as_one_chunk": False, "gradient_checkpointing": True,
        "seq_len": 48, "micro_batch_size": 2, "batch_tokens": 96, "max_steps": 2, "interpolation_steps": 2,
        "warmup_steps": 1, "tensorboard": False, "data": [{"source": "synthetic", "n": 20, "num_steps": 1}]})
    meta = json.loads((out / "melt_eval_training.json").read_text())
    assert meta["status"] == "finished" and meta["mixed_precision"] == "bf16"
    records = [json.loads(line) for line in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    # step 1 is phase 1's alpha = 0 step, exact and skipped (loss and gradient 0); the next one trains
    assert records[0]["loss"] == 0.0 and records[0]["grad_norm"] == 0.0
    assert records[1:] and all(r["loss"] == r["loss"] and r["grad_norm"] > 0 for r in records[1:])
