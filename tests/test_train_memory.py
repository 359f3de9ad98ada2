"""Chunk-wise training reads earlier tokens in place (O(L) activation memory) with the exact
gradients of the literal concatenate-and-mask forward (tests/reference_chunked.py), and the
objective never builds full [B, L, V] logits yet gives the same loss values."""

import copy

import pytest
import torch

from melt_eval.modeling import GATES, MeltForCausalLM
from melt_eval.training import load_recipe
from melt_eval.training.losses import align_loss, kd_loss, sft_loss
from melt_eval.training.runner import forward_objective

from reference_chunked import reference_forward

L = 10  # C = 3 leaves a ragged last chunk of 1


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def batch(training_batch):
    return training_batch(L, pad_from=8, loss_from=(4, 3))


def reference_loss(student, teacher, batch, C, alpha, align_beta, first_chunk=0):
    ids, attn, lm = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
    n_loss, n_tok = float(lm[:, 1:].sum()), float(attn.sum())
    s_logits, s_attn = reference_forward(student, ids, attn, C, alpha, first_chunk)
    with torch.no_grad():
        t_logits, t_attn = reference_forward(teacher, ids, attn, L)
    total = kd_loss(s_logits, t_logits, lm) / n_loss
    if align_beta:
        total = total + align_beta * align_loss(s_attn, t_attn, attn) / n_tok
    return total, sft_loss(s_logits[-1], ids, lm) / n_loss


def recipe_at(alpha, C, align_beta, whole_prompt=False):
    # alpha(step) = step / interpolation_steps: step 3 of 10 is alpha 0.3
    interp, step = {0.0: (10, 0), 0.3: (10, 3), 1.0: (0, 0)}[alpha]
    return load_recipe("tiny-phase1", overrides={"chunk_size": C, "interpolation_steps": interp, "align_beta": align_beta,
                                                 "prompt_as_one_chunk": whole_prompt}), step


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def loss_counts(batch) -> dict[str, float]:
    """The token counts `forward_objective` normalises by, for one micro-batch that is the whole batch."""
    return dict(n_loss_tokens=float(batch["loss_mask"][:, 1:].sum()), n_tokens=float(batch["attention_mask"].sum()))


def assert_reference_step(terms, student, twin, chunk_looplm, batch, C, alpha, align_beta, whole_prompt) -> None:
    """The objective's loss and every gradient equal the concatenating reference's (run on `twin`)."""
    terms.total.backward()
    ref_total, ref_sft = reference_loss(twin, chunk_looplm, batch, C, alpha, align_beta, first_chunk=3 if whole_prompt else 0)
    ref_total.backward()
    assert abs(terms.total.item() - ref_total.item()) < 1e-6
    assert abs(terms.parts["sft"] - ref_sft.item()) < 1e-6
    got, want = grads(student), grads(twin)
    assert set(got) == set(want) and len(got) > 10
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-6, rtol=0, msg=name)


@pytest.mark.parametrize("C,whole_prompt", [(1, False), (3, False), (L, False), (1, True), (3, True)])
@pytest.mark.parametrize("align_beta", [0.0, 0.1])
@pytest.mark.parametrize("alpha", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("gate", GATES)
def test_gradients_equal_the_concatenating_reference(chunk_looplm, batch, gate, alpha, align_beta, C, whole_prompt):
    """whole_prompt: the batch's shortest prompt (3 tokens) is one chunk, then chunks of C (prompt_as_one_chunk)."""
    student = MeltForCausalLM.from_looplm(chunk_looplm, gate=gate, seed=1).train()
    student.model.early_exit_gate.requires_grad_(False)
    twin = copy.deepcopy(student)
    recipe, step = recipe_at(alpha, C, align_beta, whole_prompt)
    assert recipe.alpha(step) == alpha
    counts = loss_counts(batch)
    terms, _ = forward_objective(student, chunk_looplm, batch, recipe, step, **counts)
    assert_reference_step(terms, student, twin, chunk_looplm, batch, C, alpha, align_beta, whole_prompt)


@pytest.mark.parametrize("gate", ["elementwise", "mean"])
def test_activation_checkpointing_keeps_the_gradients(chunk_looplm, batch, gate):
    recipe, step = recipe_at(0.3, 3, 0.1)
    counts = loss_counts(batch)
    results = []
    for checkpointing in (False, True):
        student = MeltForCausalLM.from_looplm(chunk_looplm, gate=gate, seed=1).train()
        if checkpointing:
            student.gradient_checkpointing_enable()
        terms, _ = forward_objective(student, chunk_looplm, batch, recipe, step, **counts)
        terms.total.backward()
        results.append(grads(student))
    for name in results[0]:
        torch.testing.assert_close(results[1][name], results[0][name], atol=1e-9, rtol=0, msg=name)


@pytest.mark.slow
def test_compiled_layer_step_keeps_the_gradients(chunk_looplm, batch):
    """torch.compile of the per-(layer, loop) step (recipe `compile: true`), inside activation
    checkpointing, at alpha < 1 (base and MELT entries) with a ragged last chunk: same loss and gradients."""
    recipe, step = recipe_at(0.3, 3, 0.1)
    counts = loss_counts(batch)
    from torch._dynamo.utils import counters

    graphs_before = counters["stats"]["unique_graphs"]
    results = []
    for compiled in (False, True):
        student = MeltForCausalLM.from_looplm(chunk_looplm, gate="elementwise", seed=1).train()
        student.gradient_checkpointing_enable()
        if compiled:
            student.model.compile_layer_step()
        terms, out = forward_objective(student, chunk_looplm, batch, recipe, step, **counts)
        terms.total.backward()
        results.append((terms.total.item(), grads(student), out.gate_means))
    assert counters["stats"]["unique_graphs"] > graphs_before  # really compiled, not a silent eager fallback
    # the gate statistics training logs: each chunk's mean taken inside the compiled step (`gate_mean`)
    assert results[0][2].shape == results[1][2].shape and not results[0][2][:, 1:].isnan().any()
    torch.testing.assert_close(results[1][2], results[0][2], atol=1e-6, rtol=0, equal_nan=True)
    assert not counters["graph_break"]
    # 1e-6, not 1e-9: RMSNorm computes in float32 (as Ouro does), and inductor may keep float64 there
    assert abs(results[1][0] - results[0][0]) < 1e-6
    for name in results[0][1]:
        torch.testing.assert_close(results[1][1][name], results[0][1][name], atol=1e-6, rtol=0, msg=name)


@pytest.mark.slow
def test_compiled_gradients_added_in_place_accumulate_over_micro_batches(chunk_looplm, batch):
    """The compiled step adds each layer weight's gradient into its .grad inside the compiled backward
    (`grads_in_place`, one process) or leaves the sum to autograd (under DDP/FSDP): both give the eager step's
    gradients summed over two micro-batches, and again after the optimizer sets .grad to None."""
    recipe, step = recipe_at(0.3, 3, 0.1)
    counts = loss_counts(batch)
    results = {}
    for name, in_place in (("eager", None), ("in place", True), ("autograd", False)):
        student = MeltForCausalLM.from_looplm(chunk_looplm, gate="elementwise", seed=1).train()
        student.gradient_checkpointing_enable()
        if in_place is not None:
            student.model.compile_layer_step(grads_in_place=in_place)
        runs = []
        for _ in range(2):  # two optimizer steps' worth, .grad set to None between them as the runner does
            for _ in range(2):  # two micro-batches accumulate into .grad
                terms, _ = forward_objective(student, chunk_looplm, batch, recipe, step, **counts)
                terms.total.backward()
            runs.append(grads(student))
            student.zero_grad(set_to_none=True)
        results[name] = runs
    layer_weights = [n for n in results["eager"][0] if ".layers." in n]
    assert layer_weights
    for name in ("in place", "autograd"):
        for got, want in zip(results[name], results["eager"]):
            assert got.keys() == want.keys()
            for weight in want:
                torch.testing.assert_close(got[weight], want[weight], atol=2e-6, rtol=0, msg=f"{name}: {weight}")


@pytest.mark.slow
def test_compiled_step_under_autocast_casts_each_weight_once_per_optimizer_step(random_looplm, batch):
    """Under bf16 autocast the in-place compiled step computes with bf16 copies of the layer's matrix weights, made
    when a weight changes (`LoopLMModel._stand_ins`) instead of cast inside every compiled (chunk, loop) step: each
    copy is autocast's cast of the weight as it is now, and over two optimizer steps the losses follow the eager
    step's (a copy left stale by the first step would repeat the first loss)."""
    teacher = random_looplm(0.1, torch.float32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=16, hidden_size=64, intermediate_size=96, loops=3)
    recipe, step = recipe_at(0.3, 3, 0.1)
    counts = loss_counts(batch)
    losses, students = {}, {}
    for name in ("eager", "compiled"):
        student = MeltForCausalLM.from_looplm(teacher, gate="elementwise", seed=1).train()
        student.gradient_checkpointing_enable()
        if name == "compiled":
            student.model.compile_layer_step()
        optimizer = torch.optim.SGD([p for p in student.parameters() if p.requires_grad], lr=0.5)
        losses[name] = []
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                terms, _ = forward_objective(student, teacher, batch, recipe, step, **counts)
            terms.total.backward()
            losses[name].append(terms.total.item())
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        students[name] = student
    (e1, e2), (c1, c2) = losses["eager"], losses["compiled"]
    assert abs(e2 - e1) > 1e-2  # the step moved the loss
    assert abs(c1 - e1) < 0.05 * abs(e2 - e1) and abs(c2 - e2) < 0.05 * abs(e2 - e1), losses
    student = students["compiled"]
    with torch.autocast("cpu", dtype=torch.bfloat16):  # one more forward, after the second step
        forward_objective(student, teacher, batch, recipe, step, **counts)
    held = student.model._working_weights
    matrices = [p for layer in student.model.layers for p in layer.parameters() if p.requires_grad and p.dim() == 2]
    assert set(held) == set(matrices)
    for p in matrices:
        assert held[p][1].dtype == torch.bfloat16 and torch.equal(held[p][1], p.detach().to(torch.bfloat16))


def test_final_mixes_differentiate_as_separate_lerps():
    """`_MixFinals` (a chunk's 2 N T phase-1 mixes in a few multi-tensor kernels) gives each lerp's output, and
    the gradients autograd gives lerp by lerp, each final MELT entry summing the gradients of its T mixes."""
    from melt_eval.modeling.kv_cache import _MixFinals

    torch.manual_seed(0)
    n_layers, loops, alpha = 3, 4, 0.3
    starts = [torch.randn(2, 1, 5, 4, dtype=torch.float64, requires_grad=True) for _ in range(2 * n_layers * loops)]
    ends = [torch.randn(2, 1, 5, 4, dtype=torch.float64, requires_grad=True) for _ in range(2 * n_layers)]
    owner = [2 * layer + kv for _ in range(loops) for layer in range(n_layers) for kv in (0, 1)]  # InterpolatedKV's order
    want_out = [torch.lerp(start, ends[end], alpha) for start, end in zip(starts, owner)]
    upstream = [torch.randn_like(out) for out in want_out]
    want = torch.autograd.grad(want_out, starts + ends, upstream)
    got_out = _MixFinals.apply(alpha, owner, len(starts), *starts, *ends)
    got = torch.autograd.grad(got_out, starts + ends, upstream)
    assert all(torch.equal(g, w) for g, w in zip(got_out, want_out))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=0)


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("c", [1, 3])
def test_prefix_attention_backward_reuses_the_forwards_log_sum_exp(monkeypatch, c, autocast):
    """On the CPU, `_PrefixAttention` keeps the flash kernel's log-sum-exp: its backward runs no attention
    forward, and its gradients (the chunk's and the prefix's) are the bits of the recomputing backward."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from melt_eval.modeling import kv_cache

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.__name__)
            return func(*args, **(kwargs or {}))

    def run():
        torch.manual_seed(0)
        past, store = 5, kv_cache.TrainingKVBuffer(capacity=5 + c)
        store.write("k", torch.randn(2, 2, 2, past, 16), 0)
        q, kv = torch.randn(2, 2, c, 16, requires_grad=True), torch.randn(2, 2, 2, c, 16, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = kv_cache._PrefixAttention.apply(q, kv, torch.zeros(()), store, "k", past)
        ops = Ops()
        with ops:
            out.backward(torch.randn_like(out))
        return out, [q.grad, kv.grad, store.grads["k"]], ops.names

    out, grads, ops = run()
    assert not any(name.startswith("_scaled_dot_product_flash_attention_for_cpu.") for name in ops), ops
    assert any(name.startswith("_scaled_dot_product_flash_attention_for_cpu_backward") for name in ops)
    monkeypatch.setattr(kv_cache, "_flash_inputs", lambda q, k, v: None)  # the recomputing backward
    want_out, want, want_ops = run()
    assert any(name.startswith("_scaled_dot_product_flash_attention_for_cpu.") for name in want_ops)
    assert torch.equal(out, want_out)
    for g, w in zip(grads, want):
        assert g.dtype == w.dtype and torch.equal(g, w)


@pytest.mark.parametrize("c", [1, 3])
def test_prefix_attention_calls_cudas_flash_kernels_as_sdpa_does(monkeypatch, c):
    """The CUDA branch's kernel calls, run on the meta device (no GPU here; a fake CUDA tensor cannot even be
    copied into without CUDA): the flash forward and its backward take the arguments their schemas ask for,
    in SDPA's order, and give gradients of the right shapes and dtypes without recomputing the attention.
    Which kernel a GPU picks, and the numbers, are the GPU's to check (benchmarks/gpu.py)."""
    from melt_eval.modeling import kv_cache

    monkeypatch.setattr(kv_cache, "_flash_inputs", lambda q, k, v: (q, k, v, None))  # as a GPU's flash takes them
    calls = []
    for name in ("_flash_forward", "_flash_backward"):
        real = getattr(kv_cache, name)
        monkeypatch.setattr(kv_cache, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))
    monkeypatch.setattr(kv_cache, "chunk_attention", lambda *a, **k: pytest.fail("the attention was recomputed"))
    past, store = 5, kv_cache.TrainingKVBuffer(capacity=5 + c)
    store.write("k", torch.empty(2, 2, 2, past, 64, device="meta", dtype=torch.bfloat16), 0)
    q = torch.empty(2, 2, c, 64, device="meta", dtype=torch.bfloat16, requires_grad=True)
    kv = torch.empty(2, 2, 2, c, 64, device="meta", dtype=torch.bfloat16, requires_grad=True)
    out = kv_cache._PrefixAttention.apply(q, kv, torch.zeros((), device="meta"), store, "k", past)
    out.backward(torch.empty_like(out))
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    for t in (q, kv):
        assert t.grad.shape == t.shape and t.grad.dtype == torch.bfloat16
    assert store.grads["k"].shape == (2, 2, 2, past + c, 64)
    assert calls == ["_flash_forward", "_flash_backward"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_a_tensor_alpha_mixes_as_a_float_alpha(dtype):
    """The compiled step's alpha is a 0-dim tensor in float32 (float64 for float64 entries); in bf16, lerp would
    round such a weight to bf16 first. `mix` gives exactly what the float weight of the eager step gives."""
    from melt_eval.modeling.gates import mix

    torch.manual_seed(0)
    start, end = torch.randn(64, 128, dtype=dtype), torch.randn(64, 128, dtype=dtype)
    for alpha in (0.0, 0.3, 0.563096284866333, 0.9, 1.0):
        weight = torch.tensor(alpha, dtype=torch.promote_types(dtype, torch.float32))
        assert torch.equal(mix(start, end, weight), mix(start, end, alpha)), alpha


@pytest.mark.slow
def test_compiled_layer_step_follows_alpha_without_recompiling(chunk_looplm, batch):
    """Phase 1 moves alpha at every step. The compiled step takes it as a tensor and mixes the chunk's entries
    inside its kernels: a new alpha runs the graphs compiled for the first one, with the eager step's gradients."""
    recipe = load_recipe("tiny-phase1", overrides={"chunk_size": 3, "interpolation_steps": 10, "align_beta": 0.0})
    counts = loss_counts(batch)
    from torch._dynamo.utils import counters

    models = {}
    for compiled in (False, True):
        models[compiled] = MeltForCausalLM.from_looplm(chunk_looplm, gate="elementwise", seed=1).train()
        models[compiled].gradient_checkpointing_enable()
    models[True].model.compile_layer_step()
    for step in (3, 6):
        assert 0 < recipe.alpha(step) < 1
        if step == 6:
            graphs, recompiles = counters["stats"]["unique_graphs"], sum(counters["recompiles"].values())
        results = []
        for compiled, student in models.items():
            student.zero_grad(set_to_none=True)
            terms, _ = forward_objective(student, chunk_looplm, batch, recipe, step, **counts)
            terms.total.backward()
            results.append(grads(student))
        for name in results[0]:
            torch.testing.assert_close(results[1][name], results[0][name], atol=1e-6, rtol=0, msg=f"step {step}: {name}")
    assert counters["stats"]["unique_graphs"] == graphs  # alpha 0.6 ran alpha 0.3's graphs
    assert sum(counters["recompiles"].values()) == recompiles


@pytest.mark.parametrize("whole_prompt", [False, True])
@pytest.mark.parametrize("align_beta", [0.0, 0.1])
@pytest.mark.parametrize("alpha", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("gate", GATES)
def test_one_function_per_token_gives_the_gradients_of_the_concatenating_reference(chunk_looplm, batch, gate, alpha,
                                                                                    align_beta, whole_prompt):
    """The chunk-1 path of `compile_token_step` (token_step.py), run uncompiled here (the same code torch.compile
    traces): every gate, the interpolation, the alignment term, grouped-query heads, right padding."""
    from melt_eval.modeling.token_step import token_chunk

    student = MeltForCausalLM.from_looplm(chunk_looplm, gate=gate, seed=1).train()
    student.model.early_exit_gate.requires_grad_(False)
    twin = copy.deepcopy(student)
    calls = []

    def counted(*args):
        calls.append(1)
        return token_chunk(*args)

    student.model.token_step = counted
    recipe, step = recipe_at(alpha, 1, align_beta, whole_prompt)
    counts = loss_counts(batch)
    terms, _ = forward_objective(student, chunk_looplm, batch, recipe, step, **counts)
    assert len(calls) == L - (3 if whole_prompt else 1)  # the fused path ran: one call per token after the first chunk
    assert_reference_step(terms, student, twin, chunk_looplm, batch, 1, alpha, align_beta, whole_prompt)


@pytest.mark.slow
def test_compiled_token_step_keeps_the_gradients(chunk_looplm, batch):
    """compile_token_step (recipe `compile: true` at chunk 1) at alpha < 1 with the alignment term, the prompt as
    one chunk: same loss and gradients as the eager store path, and one compilation serves every token."""
    recipe, step = recipe_at(0.3, 1, 0.1, whole_prompt=True)
    counts = loss_counts(batch)
    from torch._dynamo.utils import counters

    results = []
    for compiled in (False, True):
        student = MeltForCausalLM.from_looplm(chunk_looplm, gate="elementwise", seed=1).train()
        if compiled:
            student.model.compile_token_step()
            graphs_before = counters["stats"]["unique_graphs"]
        terms, _ = forward_objective(student, chunk_looplm, batch, recipe, step, **counts)
        terms.total.backward()
        results.append((terms.total.item(), grads(student)))
    assert counters["stats"]["unique_graphs"] == graphs_before + 1  # one graph for all 7 one-token chunks
    assert not counters["graph_break"]
    assert abs(results[1][0] - results[0][0]) < 1e-6
    for name in results[0][1]:
        torch.testing.assert_close(results[1][1][name], results[0][1][name], atol=1e-6, rtol=0, msg=name)


def saved_bytes(model, fn) -> int:
    """Bytes of the distinct tensors autograd saves for backward, parameters left out (they exist anyway)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(seen.values())


@pytest.mark.parametrize("checkpointing", [False, True])
def test_saved_activations_per_token_do_not_grow_with_chunks_or_length(chunk_looplm, checkpointing):
    """The memory the issue measured: bytes saved for backward per token, C = L vs C = L/20."""
    student = MeltForCausalLM.from_looplm(chunk_looplm.float(), gate="elementwise", seed=1).train()
    chunk_looplm.double()
    if checkpointing:
        student.gradient_checkpointing_enable()
    per_token = {}
    for length in (80, 160):
        ids = torch.randint(5, 500, (1, length))
        for C in (length, length // 20):
            per_token[length, C] = saved_bytes(student, lambda: student(ids, chunk_size=C, compute_logits=False).last_hidden_state) / length
    for (length, C), value in per_token.items():
        assert value <= 1.1 * per_token[length, length], (length, C, per_token)
    assert per_token[160, 8] <= 1.1 * per_token[80, 4]


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("alpha", [0.3, 1.0])
def test_a_training_step_frees_its_kv_buffers(chunk_looplm, monkeypatch, checkpointing, alpha):
    """Each step's KV buffers are freed once its backward is done. A reference cycle through the autograd
    graph (the store holding its latest commit, whose node holds the store) once kept every step's
    buffers alive: a 200-step chunk-1 run grew by 100 MB a step and exhausted the machine."""
    import gc
    import weakref

    from melt_eval.modeling import kv_cache

    stores = []
    init = kv_cache.TrainingKVBuffer.__init__

    def tracked(self, capacity):
        init(self, capacity)
        stores.append(weakref.ref(self))

    monkeypatch.setattr(kv_cache.TrainingKVBuffer, "__init__", tracked)
    student = MeltForCausalLM.from_looplm(chunk_looplm.float(), gate="elementwise", seed=1).train()
    chunk_looplm.double()
    if checkpointing:
        student.gradient_checkpointing_enable()
    out = student(torch.randint(5, 500, (2, 12)), chunk_size=3, alpha=alpha, output_loop_states=True)
    out.logits.mean().backward()
    del out
    gc.collect()
    assert len(stores) == 1 and stores[0]() is None


def test_right_padding_is_required(chunk_looplm):
    ids = torch.randint(5, 500, (1, 6))
    with pytest.raises(ValueError, match="right-padded"):
        chunk_looplm(ids, attention_mask=torch.tensor([[0, 1, 1, 1, 1, 1]]))


def test_a_steps_gradient_does_not_depend_on_how_it_is_bucketed(chunk_looplm):
    """Length bucketing regroups a step's sequences; with step-level token normalisation the gradient is the same."""
    from melt_eval.training.data import Example, bucket, collate

    g = torch.Generator().manual_seed(3)
    exs = [Example(torch.randint(5, 500, (n,), generator=g).tolist(), [False] * 2 + [True] * (n - 2)) for n in (9, 4, 7, 5)]
    recipe, step = recipe_at(1.0, 3, 0.0)
    results = []
    padded = bucket(exs, 2, 0, pad_multiple=3)  # a compiled step's whole chunks
    assert [b["input_ids"].shape[1] for b in padded] == [9, 6]
    for batches in ([collate(exs[:2], 0), collate(exs[2:], 0)], bucket(exs, 2, 0), padded):
        student = MeltForCausalLM.from_looplm(chunk_looplm, gate="elementwise", seed=1).train()
        n_loss = sum(float(b["loss_mask"][:, 1:].sum()) for b in batches)
        n_tok = sum(float(b["attention_mask"].sum()) for b in batches)
        for b in batches:
            terms, _ = forward_objective(student, chunk_looplm, b, recipe, step, n_loss_tokens=n_loss, n_tokens=n_tok)
            terms.total.backward()
        results.append(grads(student))
    for name in results[0]:
        torch.testing.assert_close(results[1][name], results[0][name], atol=1e-9, rtol=0, msg=name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (an 80 GB H100)")
def test_paper_phase1_step_fits_one_h100():
    """MELT-1.6B (random weights), L = 10,000, C = 500, phase 1 with the frozen teacher and KD, B = 1."""
    import time

    from melt_eval.modeling import LoopLMConfig, LoopLMForCausalLM
    from melt_eval.training.runner import param_groups

    config = LoopLMConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=24, num_attention_heads=16,
                          head_dim=128, vocab_size=49152, total_ut_steps=4, max_position_embeddings=65536)
    with torch.device("cuda"):
        teacher = LoopLMForCausalLM(config)
    student = MeltForCausalLM.from_looplm(teacher, gate="elementwise", seed=0).train()
    student.model.early_exit_gate.requires_grad_(False)
    student.gradient_checkpointing_enable()
    teacher = teacher.to(torch.bfloat16).eval().requires_grad_(False)
    recipe = load_recipe("paper-phase1", overrides={"data": [{"source": "synthetic"}]})
    opt = torch.optim.AdamW(param_groups(student, recipe), betas=(0.9, 0.95))
    L = 10_000
    ids = torch.randint(0, config.vocab_size, (1, L), device="cuda")
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids, dtype=torch.bool),
             "loss_mask": torch.ones_like(ids, dtype=torch.bool)}
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        terms, _ = forward_objective(student, teacher, batch, recipe, 250, n_loss_tokens=L, n_tokens=L,
                                     teacher_autocast=lambda: torch.autocast("cuda", dtype=torch.bfloat16))
    terms.total.backward()
    opt.step()
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated()
    print(f"phase-1 step: peak {peak / 2**30:.1f} GiB, {L / dt:.0f} tokens/s")
    assert peak < 80e9 and torch.isfinite(terms.total)
