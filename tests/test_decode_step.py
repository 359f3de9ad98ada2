"""The native engine's captured decode step (generation/decode_step.py), proven on the CPU: compiled whole
(inductor, fullgraph) it gives the eager step's greedy tokens, padded rows included, and it compiles once for
every position; the caches it does not take decode eagerly with a warning. CUDA graphs need a GPU
(benchmarks/gpu.py's decode_graphed measure runs them)."""

from __future__ import annotations

import pytest
import torch

from melt_eval.errors import UserError
from melt_eval.generation import decode_step, engine
from melt_eval.generation.decode_step import DecodeStep
from melt_eval.generation.engine import generate
from melt_eval.generation.options import InferenceOptions
from melt_eval.modeling.kv_cache import StaticStore
from melt_eval.modeling.melt import MeltForCausalLM

PROMPTS = [[5, 9, 11, 3, 7, 2, 8], [4, 8], [6, 1, 12, 13]]  # three lengths: rows 1 and 2 are left-padded
GREEDY = dict(n=2, temperature=0.0, max_new_tokens=12)


@pytest.fixture(scope="module")
def models(random_looplm):
    ouro = random_looplm(0.3)
    return {"ouro": ouro, "melt": MeltForCausalLM.from_looplm(ouro).eval()}


@pytest.mark.slow  # inductor compiles the whole step once per model (tens of seconds on a loaded 2-core machine)
@pytest.mark.parametrize("kind,options", [
    ("ouro", InferenceOptions()),  # per-loop cache
    ("melt", InferenceOptions()),  # shared cache, element-wise gates
    ("ouro", InferenceOptions(kv_sharing="last", share_prompt=True)),  # untrained sharing: fixed gates
])
def test_the_compiled_step_gives_the_eager_tokens(models, kind, options):
    eager = generate(models[kind], PROMPTS, options, **GREEDY)
    compiled = generate(models[kind], PROMPTS, options, decode_mode="compiled", **GREEDY)
    assert compiled.sequences == eager.sequences
    assert all(len(s) == GREEDY["max_new_tokens"] for per in eager.sequences for s in per)  # 11 decode steps each
    assert len({tuple(per[0]) for per in eager.sequences}) == 3  # the rows' tokens differ: each reads its own cache
    for e, c in zip(eager.logprobs, compiled.logprobs):
        assert torch.allclose(torch.tensor(e), torch.tensor(c), atol=5e-3)  # inductor reorders fp32 sums


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ouro", "melt"])
def test_frozen_weights_compile_in_and_a_change_to_them_is_seen(models, kind):
    """The native backend evaluates a model that trains nothing; its compiled step holds the weights as constants
    (inductor's freezing, which merges q|k|v and gate|up). Its tokens are the eager step's, and weights changed
    in place afterwards reach the next compiled step instead of the constants of the first."""
    import copy

    model = copy.deepcopy(models[kind]).requires_grad_(False)
    assert decode_step.frozen_weights_config(model)["freezing"] is True
    eager = generate(model, PROMPTS, InferenceOptions(), **GREEDY)
    assert generate(model, PROMPTS, InferenceOptions(), decode_mode="compiled", **GREEDY).sequences == eager.sequences
    with torch.no_grad():
        model.lm_head.weight.mul_(-1.0)  # the opposite preferences: other tokens
    changed = generate(model, PROMPTS, InferenceOptions(), **GREEDY)
    assert changed.sequences != eager.sequences
    assert generate(model, PROMPTS, InferenceOptions(), decode_mode="compiled", **GREEDY).sequences == changed.sequences
    assert decode_step.frozen_weights_config(models[kind]) == {}  # a model with trainable weights keeps them as inputs


@pytest.fixture(scope="module")
def models64(random_looplm):
    ouro = random_looplm(0.3, dtype=torch.float64)
    return {"ouro": ouro, "melt": MeltForCausalLM.from_looplm(ouro).eval()}


def _wave(model, capacity=80, past=6):
    cfg = model.config
    keys, _ = model.cache_layout().store_keys()
    store = StaticStore(keys, batch=2, kv_heads=cfg.num_key_value_heads, capacity=capacity, head_dim=cfg.head_dim,
                        dtype=model.lm_head.weight.dtype, device="cpu")
    g = torch.Generator().manual_seed(0)
    for buffer in (t for pair in store.buffers.values() for t in pair):
        buffer[:, :, :past].normal_(generator=g)  # the prompt's entries
    store.length = past
    key_mask = torch.ones(2, capacity, dtype=torch.bool)
    key_mask[1, :2] = False  # row 1 left-padded
    return store, key_mask


@pytest.mark.parametrize("kind", ["ouro", "melt"])
def test_the_step_is_one_graph_that_never_recompiles_as_the_position_moves(models64, kind):
    """What torch.compile is handed (dynamo, a counting backend): one frame over 64 positions, no graph break, and
    at every position in float64 the eager step's greedy tokens, logits and cache entries to rounding. Not to the
    bit: the captured step attends over the whole capacity under the mask, so the CPU's SDPA sums in another
    order (float64's last bits, which RMSNorm, normalising float64 in float64, carries on). Each step starts
    from the eager cache, so that a random model's loops and gates do not amplify one step's rounding into the
    next; a key read wrong or left out changes the logits at O(1)."""
    models = models64
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    counter = CompileCounter()
    store, key_mask = _wave(models[kind])
    step = DecodeStep(models[kind], models[kind].make_policy(store), key_mask, mode="compiled", backend=counter)
    eager_store, _ = _wave(models[kind])
    eager = DecodeStep(models[kind], models[kind].make_policy(eager_store), key_mask)
    tokens, pos = torch.tensor([[3], [5]]), torch.tensor([[6], [4]])
    pairs = [(got, eager_store.buffers[key][i]) for key, bufs in store.buffers.items() for i, got in enumerate(bufs)]
    with torch.no_grad():
        for _ in range(64):  # both fed the eager step's greedy tokens
            got, want = step(tokens, pos), eager(tokens, pos)
            assert torch.equal(got.argmax(-1), want.argmax(-1))
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)  # the step's logits are float32
            for mine, theirs in pairs:  # the device-addressed writes land where the eager ones do
                torch.testing.assert_close(mine, theirs, rtol=1e-9, atol=1e-9)
                mine.copy_(theirs)
            tokens, pos = want.argmax(-1, keepdim=True), pos + 1
    assert counter.frame_count == 1 and sum(torch._dynamo.utils.counters["graph_break"].values()) == 0
    assert store.length == eager_store.length == 70
    assert not any(mine[:, :, 70:].any() for mine, _ in pairs)  # nothing written past the last column


def test_a_full_cache_is_refused_before_the_step_runs(models):
    store, key_mask = _wave(models["melt"], capacity=7, past=6)
    step = DecodeStep(models["melt"], models["melt"].make_policy(store), key_mask, mode="compiled", backend="eager")
    with torch.no_grad():
        step(torch.tensor([[3], [5]]), torch.tensor([[6], [4]]))
        with pytest.raises(RuntimeError, match="KV cache full"):
            step(torch.tensor([[3], [5]]), torch.tensor([[7], [5]]))


@pytest.mark.parametrize("options,why", [
    (InferenceOptions(kv_cache_dtype="int8"), "quantized"),
    (InferenceOptions(kv_sharing="last"), "per-loop-prompt"),  # "w/ prefill": the prompt keeps Ouro's cache
    (InferenceOptions(exit="agree:1"), "early exit"),
])
def test_caches_the_captured_step_does_not_take_decode_eagerly_with_a_warning(models, monkeypatch, options, why):
    monkeypatch.setattr(engine, "_NOTED", set())
    eager = generate(models["ouro"], PROMPTS, options, **GREEDY)
    with pytest.warns(UserWarning, match=why):
        asked = generate(models["ouro"], PROMPTS, options, decode_mode="compiled", **GREEDY)
    assert asked.sequences == eager.sequences


def test_graphs_need_cuda_and_the_option_is_a_flag(models):
    with pytest.raises(ValueError, match="needs a CUDA device"):
        generate(models["melt"], PROMPTS, decode_mode="graphed", **GREEDY)
    with pytest.raises(UserError, match="--no-cuda-graphs"):
        InferenceOptions(cuda_graphs="no")
    # on the CPU the default is eager, whatever the option says
    assert decode_step.captured_mode("cpu", None, cuda_graphs=True) == ("eager", None)


@pytest.mark.parametrize("flags,graphs", [([], True), (["--no-cuda-graphs"], False)])
def test_the_run_flag_reaches_the_engine_options(monkeypatch, flags, graphs):
    from typer.testing import CliRunner

    import melt_eval.evaluation as evaluation
    from melt_eval.cli import app

    seen = {}
    monkeypatch.setattr(evaluation, "run_tasks", lambda tasks, model, options, *a, **k: seen.setdefault("o", options) and [])
    result = CliRunner().invoke(app, ["run", "synthetic", "--model", "tiny-random-melt", *flags])
    assert result.exit_code == 0, result.output
    assert seen["o"].cuda_graphs is graphs
    help_text = CliRunner().invoke(app, ["run", "--help"], env={"COLUMNS": "200"}).output
    assert "--no-cuda-graphs" in help_text
