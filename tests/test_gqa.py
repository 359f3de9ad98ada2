"""Grouped-query MELT (recipe key `kv_heads`, docs/training.md#grouped-query-melt): the conversion's mean-pooling,
the cache it saves, a phase-1 run that converts, and chunk-wise training's gradients with fewer key/value heads."""

import copy

import pytest
import torch

from melt_eval.cache_layout import layout_of
from melt_eval.errors import UserError
from melt_eval.generation import generate
from melt_eval.modeling import MeltForCausalLM, load_model
from melt_eval.training import load_recipe, run_recipe
from melt_eval.training.runner import forward_objective

from test_train_memory import L, assert_reference_step, loss_counts, recipe_at

HEADS = 4
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def looplm(random_looplm):
    return random_looplm(0.1, torch.float64, num_hidden_layers=2, num_attention_heads=HEADS, head_dim=16, hidden_size=64,
                         intermediate_size=96, loops=3)


@pytest.fixture(scope="module")
def batch(training_batch):
    return training_batch(L, pad_from=8, loss_from=(4, 3))


def greedy(model, n_new=8):
    return generate(model, [[5, 6, 7, 8, 9], [11, 12]], temperature=0.0, max_new_tokens=n_new)


def test_kv_heads_equal_to_the_heads_is_the_identity(looplm):
    plain = MeltForCausalLM.from_looplm(looplm, seed=1).eval()
    same = MeltForCausalLM.from_looplm(looplm, seed=1, kv_heads=HEADS).eval()
    assert same.config.num_key_value_heads == HEADS
    for (name, a), (_, b) in zip(plain.state_dict().items(), same.state_dict().items()):
        assert torch.equal(a, b), name
    assert greedy(plain).sequences == greedy(same).sequences


@pytest.mark.parametrize("K", [1, 2])
def test_each_key_value_head_is_the_mean_of_its_group(looplm, K):
    gqa = MeltForCausalLM.from_looplm(looplm, seed=1, kv_heads=K)
    assert gqa.config.num_key_value_heads == K and gqa.config.num_attention_heads == HEADS
    hd, group = looplm.config.head_dim, HEADS // K
    h = torch.randn(1, 3, looplm.config.hidden_size, dtype=torch.float64)
    cos, sin = looplm.model.rotary_emb(torch.arange(3)[None], torch.float64)
    for half in (0, 1):  # kv_proj holds k_proj's rows, then v_proj's
        w = looplm.model.layers[1].self_attn.kv_proj.weight.chunk(2)[half]  # [HEADS * hd, d]
        pooled = gqa.model.layers[1].self_attn.kv_proj.weight.chunk(2)[half]
        assert pooled.shape == (K * hd, w.shape[1])
        for g in range(K):
            want = torch.stack([w[j * hd:(j + 1) * hd] for j in range(g * group, (g + 1) * group)]).mean(0)
            torch.testing.assert_close(pooled[g * hd:(g + 1) * hd], want, atol=1e-12, rtol=0)
    # RoPE is linear: the pooled head's keys are the mean of its group's keys, and so are its values
    k, v = looplm.model.layers[1].self_attn.key_value(h, cos, sin)  # [1, HEADS, 3, hd]
    pk, pv = gqa.model.layers[1].self_attn.key_value(h, cos, sin)  # [1, K, 3, hd]
    torch.testing.assert_close(pk, k.view(1, K, group, 3, hd).mean(2))
    torch.testing.assert_close(pv, v.view(1, K, group, 3, hd).mean(2))


def test_groups_are_the_query_heads_each_key_head_serves(looplm):
    """With every group's heads equal, pooling loses nothing: the converted model generates the unconverted one's
    tokens, which holds only if a group is the consecutive query heads attention gives its key head."""
    twin = copy.deepcopy(looplm)
    hd = twin.config.head_dim
    with torch.no_grad():
        for layer in twin.model.layers:
            w = layer.self_attn.kv_proj.weight.view(2, 2, HEADS // 2, hd, -1)  # (k, v), 2 groups, heads of a group
            w.copy_(w[:, :, :1].expand_as(w))
    full = MeltForCausalLM.from_looplm(twin, seed=1).eval()
    pooled = MeltForCausalLM.from_looplm(twin, seed=1, kv_heads=2).eval()
    assert greedy(full).sequences == greedy(pooled).sequences
    ids = torch.randint(5, 400, (1, 12), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(pooled(ids).logits, full(ids).logits, atol=1e-9, rtol=0)


def test_a_k_that_does_not_divide_the_heads_is_refused(looplm):
    with pytest.raises(ValueError, match=r"kv_heads must divide the model's 4 key/value heads .*one of 1, 2, 4; got 3"):
        MeltForCausalLM.from_looplm(looplm, kv_heads=3)
    with pytest.raises(UserError, match="kv_heads must be a whole number >= 1"):
        load_recipe("tiny-phase1", overrides={"kv_heads": 0})
    with pytest.raises(UserError, match="applies to target melt only"):
        load_recipe("pretrain-tiny", overrides={"kv_heads": 1})


@pytest.mark.parametrize("K", [1, 2])
def test_the_cache_shrinks_by_k_over_the_heads(looplm, K):
    """Measured: the native engine's stored tensors; counted: the cache layout's bytes per token."""
    full = MeltForCausalLM.from_looplm(looplm, seed=1).eval()
    gqa = MeltForCausalLM.from_looplm(looplm, seed=1, kv_heads=K).eval()
    a, b = greedy(full), greedy(gqa)
    assert b.peak_cache_bytes * HEADS == a.peak_cache_bytes * K > 0
    assert layout_of(gqa.config).bytes_per_token() * HEADS == layout_of(full.config).bytes_per_token() * K
    assert b.peak_cache_bytes == 2 * layout_of(gqa.config).nbytes(5, 8, bytes_per_value=8)  # 2 rows, float64


FAST = {"seq_len": 64, "micro_batch_size": 4, "batch_tokens": 256, "warmup_steps": 1, "save_every": 0,
        "chunk_size": 8, "interpolation_steps": 2, "data": [{"source": "synthetic", "n": 50, "num_steps": 1}],
        "tensorboard": False}


def test_phase1_converts_trains_and_the_checkpoint_reloads_and_generates(tmp_path):
    """tiny-random-ouro has 2 heads: kv_heads 1 is multi-query MELT; phase 2 then continues it under the
    recorded (unpooled) teacher."""
    p1, p2 = tmp_path / "p1", tmp_path / "p2"
    run_recipe("tiny-phase1", "tiny-random-ouro", p1, progress=False, overrides={**FAST, "max_steps": 2, "kv_heads": 1})
    model, tok = load_model(str(p1))
    assert isinstance(model, MeltForCausalLM) and model.config.num_key_value_heads == 1
    assert model.model.layers[0].self_attn.kv_proj.weight.shape == (2 * model.config.head_dim, model.config.hidden_size)
    ouro, _ = load_model("tiny-random-ouro")
    assert layout_of(model.config).bytes_per_token() * 2 == layout_of(MeltForCausalLM.from_looplm(ouro).config).bytes_per_token()
    res = generate(model, [tok("x = 3; y = x + 4.")["input_ids"]], max_new_tokens=5, temperature=1.0, seed=0)
    assert len(res.sequences[0][0]) >= 1 and res.peak_cache_bytes > 0
    run_recipe("tiny-phase2", str(p1), p2, progress=False, overrides={**FAST, "interpolation_steps": 0, "max_steps": 1})
    assert load_model(str(p2))[0].config.num_key_value_heads == 1
    with pytest.raises(UserError, match="kv_heads must divide the model's 2 key/value heads"):
        run_recipe("tiny-phase1", "tiny-random-ouro", tmp_path / "bad", progress=False, overrides={**FAST, "kv_heads": 3})
    assert not (tmp_path / "bad").exists()
    with pytest.raises(UserError, match="is a MELT checkpoint with 1 key/value heads"):
        run_recipe("tiny-phase2", str(p1), tmp_path / "bad2", progress=False,
                   overrides={**FAST, "interpolation_steps": 0, "kv_heads": 2})


def test_a_kv_heads_that_does_not_divide_the_heads_is_refused_before_the_weights_load(tmp_path, monkeypatch):
    """Read from the LoopLM's config.json (issue 69, hostile round 6: it was said at conversion, after --from's
    weights loaded: seconds for the tiny model, the whole load for Ouro-1.4B)."""
    def no_load(*args, **kwargs):
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr("melt_eval.modeling.load_model", no_load)
    with pytest.raises(UserError, match=r"kv_heads must divide the model's 2 key/value heads .*got 3 \(tiny-random-ouro\)"):
        run_recipe("tiny-phase1", "tiny-random-ouro", tmp_path / "bad", progress=False, overrides={**FAST, "kv_heads": 3})
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize("K", [1, 2])
@pytest.mark.parametrize("alpha,C,align_beta", [(0.3, 3, 0.1), (1.0, 1, 0.0), (0.0, L, 0.1)])
def test_chunkwise_gradients_equal_the_reference_with_pooled_heads(looplm, batch, K, alpha, C, align_beta):
    """The student has K key/value heads, its teacher (the LoopLM it was pooled from) all of them."""
    student = MeltForCausalLM.from_looplm(looplm, seed=1, kv_heads=K).train()
    student.model.early_exit_gate.requires_grad_(False)
    twin = copy.deepcopy(student)
    recipe, step = recipe_at(alpha, C, align_beta)
    terms, _ = forward_objective(student, looplm, batch, recipe, step, **loss_counts(batch))
    assert_reference_step(terms, student, twin, looplm, batch, C, alpha, align_beta, False)


def test_registry_and_memory_table_count_the_pooled_heads():
    """tiny-random-melt-gqa: the registry's figures are the built checkpoint's, half of tiny-random-melt's."""
    from melt_eval.registry import get_spec
    from melt_eval.report.memory import kv_bytes_per_token_at, memory_row
    from melt_eval.modeling.loading import resolve_model_dir

    model, _ = load_model("tiny-random-melt-gqa")
    spec = get_spec("tiny-random-melt-gqa")
    assert model.config.num_key_value_heads == spec.num_kv_heads == 1
    assert spec.kv_bytes_per_token == layout_of(model.config).bytes_per_token(2)  # bf16
    assert 2 * memory_row("tiny-random-melt-gqa").kv_bytes_per_token == memory_row("tiny-random-melt").kv_bytes_per_token
    # a checkpoint directory outside the registry: its config.json's num_key_value_heads
    path = str(resolve_model_dir("tiny-random-melt-gqa"))
    assert kv_bytes_per_token_at("my-gqa-run", path, None) == spec.kv_bytes_per_token


def test_kv_compression_plans_a_gqa_melt_row_per_model_size():
    """`ablate kv-compression`'s GQA-MELT row trains both phases with the heads pooled in phase 1, into a K that
    divides each preset's base (tiny: 2 -> 1, paper: 16 -> 4), and the frontier draws it as its own family."""
    from types import SimpleNamespace

    from melt_eval.experiments.ablations import PRESETS, plan
    from melt_eval.registry import get_spec
    from melt_eval.report.plots import _family

    for preset, k in (("tiny", 1), ("paper", 4)):
        row = next(v for v in plan("kv-compression", preset) if v.name == "melt-gqa")
        assert [(r.phase, r.overrides) for r in row.train] == [(1, {"kv_heads": k}), (2, {})]
        heads = get_spec(PRESETS[preset]["base"]).num_kv_heads
        assert heads % k == 0 and heads > k
    result = SimpleNamespace(settings={}, model="melt-gqa")
    assert _family(("kv-compression", "melt-gqa"), result) == "GQA-MELT"
