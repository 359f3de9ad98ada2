"""LoopLM and MELT: the equalities docs/method.md pins down, checkpoints, and the native engine."""

import copy
import json

import pytest
import torch
from safetensors import safe_open

from melt_eval.errors import UserError
from melt_eval.generation import generate
from melt_eval.generation.options import InferenceOptions
from melt_eval.modeling import GATES, LoopLMConfig, LoopLMForCausalLM, MeltConfig, MeltForCausalLM, load_model
from melt_eval.modeling.loading import load_looped
from melt_eval.registry import melt_gate_params

ATOL = 1e-5


@pytest.fixture(scope="module")
def looplm(random_looplm):
    # a slightly deeper stack than the registry's tiny model, with GQA, to exercise more paths
    return random_looplm(0.08, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32)


@pytest.fixture(scope="module")
def ids():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 500, (2, 11), generator=g)


def melt(looplm, gate, seed=0):
    return MeltForCausalLM.from_looplm(looplm, gate=gate, seed=seed).eval()


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("chunk", [1, 4, 11])
def test_alpha_zero_is_the_looplm(looplm, ids, gate, chunk):
    expected = looplm(ids).logits
    got = melt(looplm, gate)(ids, alpha=0.0, chunk_size=chunk).logits
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("alpha", [0.5, 1.0])
def test_a_chunked_forward_runs_under_inference_mode(looplm, ids, alpha):
    """`torch.inference_mode`, as Hugging Face users call a model: the chunked forward (its KV store, the commits
    of each chunk's entries) gives no_grad's logits, for the LoopLM and MELT (interpolated and shared caches)."""
    for model in (looplm, melt(looplm, "elementwise")):
        with torch.no_grad():
            want = model(ids, chunk_size=4, **({"alpha": alpha} if model is not looplm else {})).logits
        with torch.inference_mode():
            got = model(ids, chunk_size=4, **({"alpha": alpha} if model is not looplm else {})).logits
        assert torch.equal(got, want)


@pytest.mark.parametrize("gate", GATES)
def test_variants_differ_from_looplm_at_alpha_one(looplm, ids, gate):
    """Guards the test above: alpha really switches the cache (except where it cannot matter)."""
    diff = (melt(looplm, gate)(ids, chunk_size=4).logits - looplm(ids).logits).abs().max()
    assert diff > 1e-3


@pytest.mark.parametrize("gate", GATES)
def test_chunk_size_one_equals_token_by_token_decoding(looplm, gate):
    model = melt(looplm, gate)
    prompt = [5, 17, 42, 99, 3]
    result = generate(model, [prompt], temperature=0, max_new_tokens=8)
    seq = result.sequences[0][0]
    full = torch.tensor([prompt + seq])
    logits = model(full, chunk_size=1).logits[0, len(prompt) - 1 : -1]
    assert logits.argmax(-1).tolist() == seq
    expected_lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(seq)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(result.logprobs[0][0]), expected_lp, atol=ATOL, rtol=0)


def test_chunked_prefill_follows_the_chunk_rule(looplm):
    """A prompt prefilled in chunks of C equals the teacher-forced forward with chunk_size=C."""
    model = melt(looplm, "elementwise")
    prompt = list(range(10, 23))
    result = generate(model, [prompt], InferenceOptions(prefill_chunk=4), temperature=0, max_new_tokens=1)
    logits = model(torch.tensor([prompt]), chunk_size=4).logits[0, -1]
    assert result.sequences[0][0] == [int(logits.argmax())]
    assert result.logprobs[0][0][0] == pytest.approx(float(torch.log_softmax(logits, -1).max().detach()), abs=ATOL)
    exact = model(torch.tensor([prompt]), chunk_size=1).logits[0, -1]
    assert (exact - logits).abs().max() > 1e-4  # chunking really changes MELT


@pytest.mark.parametrize("gate", ["elementwise", "mean"])
def test_whole_prompt_prefill_equals_forward_with_the_prompt_as_first_chunk(looplm, gate):
    """Training with `prompt_as_one_chunk` is the rule of generation with a prefill chunk >= the prompt."""
    model = melt(looplm, gate)
    prompt = [5, 17, 42, 99, 3, 8, 61]
    result = generate(model, [prompt], InferenceOptions(prefill_chunk=64), temperature=0, max_new_tokens=8)
    seq = result.sequences[0][0]
    full = torch.tensor([prompt + seq])
    logits = model(full, chunk_size=1, first_chunk=len(prompt)).logits[0, len(prompt) - 1 : -1]
    assert logits.argmax(-1).tolist() == seq
    expected_lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(seq)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(result.logprobs[0][0]), expected_lp, atol=ATOL, rtol=0)
    exact = model(full, chunk_size=1).logits[0, len(prompt) - 1 : -1]
    assert (exact - logits).abs().max() > 1e-4  # the prompt's chunk really changes what follows it


def test_looplm_decoding_matches_forward(looplm):
    prompt = [7, 8, 9, 10]
    result = generate(looplm, [prompt], temperature=0, max_new_tokens=6)
    seq = result.sequences[0][0]
    logits = looplm(torch.tensor([prompt + seq])).logits[0, len(prompt) - 1 : -1]
    assert logits.argmax(-1).tolist() == seq


@pytest.mark.parametrize("sharing", ["first", "last"])
def test_untrained_gates_equal_looplm_kv_sharing(looplm, ids, sharing):
    expected = looplm(ids, kv_sharing=sharing).logits
    torch.testing.assert_close(melt(looplm, sharing)(ids).logits, expected, atol=ATOL, rtol=0)
    prompt = ids[0, :5].tolist()
    a = generate(looplm, [prompt], InferenceOptions(kv_sharing=sharing, share_prompt=True), temperature=0, max_new_tokens=5)
    b = generate(melt(looplm, sharing), [prompt], temperature=0, max_new_tokens=5)
    assert a.sequences == b.sequences


def test_kv_sharing_with_prefill_keeps_ouro_prompt_cache(looplm):
    prompt = [4, 40, 44, 101, 7, 9]
    ouro = generate(looplm, [prompt], temperature=0, max_new_tokens=1)
    shared = generate(looplm, [prompt], InferenceOptions(kv_sharing="last"), temperature=0, max_new_tokens=6)
    # the first token comes from the prompt alone, which w/ prefill is exactly Ouro's
    assert shared.sequences[0][0][0] == ouro.sequences[0][0][0]
    cfg = looplm.config
    per_entry = 2 * cfg.num_key_value_heads * cfg.head_dim * 4
    T, N = cfg.total_ut_steps, cfg.num_hidden_layers
    assert shared.peak_cache_bytes == per_entry * N * (T * len(prompt) + 6)


def test_ema_equals_elementwise_gate_held_at_constant(looplm, ids):
    held = melt(looplm, "elementwise")
    with torch.no_grad():
        for layer in held.model.layers:
            layer.melt_gate.ah_proj.weight.zero_()
            layer.melt_gate.bias.fill_(torch.logit(torch.tensor(0.2)).item())
    torch.testing.assert_close(held(ids).logits, melt(looplm, "ema")(ids).logits, atol=ATOL, rtol=0)


def test_mean_gate_gives_running_mean(looplm):
    layer = melt(looplm, "mean").model.layers[0]
    a = [torch.randn(2, 3, looplm.config.hidden_size) for _ in range(5)]
    h = a[0]
    for t in range(2, 6):
        h, z = layer.update_state(h, a[t - 1], t)
        assert z == pytest.approx((t - 1) / t)
        torch.testing.assert_close(h, torch.stack(a[:t]).mean(0), atol=ATOL, rtol=0)


@pytest.mark.parametrize("gate", GATES)
def test_one_chunk_loop_one_equals_looplm_loop_one(looplm, ids, gate):
    base = looplm(ids, output_loop_states=True)
    out = melt(looplm, gate)(ids, chunk_size=ids.shape[1], output_loop_states=True)
    torch.testing.assert_close(out.loop_logits[0], base.loop_logits[0], atol=ATOL, rtol=0)
    assert len(out.loop_logits) == looplm.config.total_ut_steps
    assert len(out.attn_outputs) == looplm.config.num_hidden_layers
    assert out.attn_outputs[0][0].shape == (*ids.shape, looplm.config.hidden_size)


def test_gate_means_and_gate_parameters(looplm, ids):
    model = melt(looplm, "elementwise")
    means = model(ids, chunk_size=4, output_loop_states=True).gate_means
    assert means.shape == (looplm.config.num_hidden_layers, looplm.config.total_ut_steps)
    assert torch.isnan(means[:, 0]).all() and ((means[:, 1:] > 0) & (means[:, 1:] < 1)).all()
    names = [n for n, p in model.named_parameters() if any(p is q for q in model.gate_parameters())]
    assert names and all(".melt_gate." in n for n in names)
    d, N = looplm.config.hidden_size, looplm.config.num_hidden_layers
    assert sum(p.numel() for p in model.gate_parameters()) == melt_gate_params(N, d) == N * (2 * d * d + d)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_measured_cache_bytes(looplm, dtype):
    cfg = looplm.config
    prompt, new = [1, 2, 3, 4, 5, 6, 7], 9
    L, N, T = len(prompt) + new, cfg.num_hidden_layers, cfg.total_ut_steps
    nbytes = torch.tensor([], dtype=dtype).element_size()
    expected_melt = N * L * 2 * cfg.num_key_value_heads * cfg.head_dim * nbytes
    m = melt(looplm, "elementwise").to(dtype)
    got_melt = generate(m, [prompt], temperature=0, max_new_tokens=new).peak_cache_bytes
    got_ouro = generate(copy.deepcopy(looplm).to(dtype), [prompt], temperature=0, max_new_tokens=new).peak_cache_bytes
    assert got_melt == expected_melt
    assert got_ouro == T * expected_melt


def test_melt_cache_is_flat_in_loops(looplm):
    m = melt(looplm, "elementwise")
    sizes = []
    for T in (1, 2, 4, 8):
        m.config.total_ut_steps = T
        sizes.append(generate(m, [[1, 2, 3]], temperature=0, max_new_tokens=4).peak_cache_bytes)
    m.config.total_ut_steps = 4
    assert len(set(sizes)) == 1


def test_sampling_is_seeded_per_prompt_and_sample(looplm):
    p1, p2 = [3, 4, 5], [9, 10]
    both = generate(looplm, [p1, p2], n=4, temperature=1.0, top_p=0.7, max_new_tokens=6, seed=[11, 12])
    alone = generate(looplm, [p2], n=2, temperature=1.0, top_p=0.7, max_new_tokens=6, seed=[12])
    assert both.sequences[1][:2] == alone.sequences[0]
    again = generate(looplm, [p1, p2], n=4, temperature=1.0, top_p=0.7, max_new_tokens=6, seed=[11, 12])
    assert again.sequences == both.sequences
    other = generate(looplm, [p1, p2], n=4, temperature=1.0, top_p=0.7, max_new_tokens=6, seed=[13, 14])
    assert other.sequences != both.sequences


def test_nucleus_sampling_draws_from_the_renormalised_top_p_mass():
    from melt_eval.generation import sample_next

    rows = 200_000
    logits = torch.tensor([0.15, 0.5, 0.0, 0.3, 0.05]).log().expand(rows, 5)  # token 2 has no mass
    u = torch.rand(rows, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    # top-p 0.7: tokens 1 (0.5) and 3 (0.3) reach it; they keep their ratio 5:3
    counts = torch.bincount(sample_next(logits, 1.0, 0.7, u), minlength=5).double() / rows
    torch.testing.assert_close(counts, torch.tensor([0, 0.625, 0, 0.375, 0], dtype=torch.float64), atol=4e-3, rtol=0)
    counts = torch.bincount(sample_next(logits, 1.0, 1.0, u), minlength=5).double() / rows
    torch.testing.assert_close(counts, torch.tensor([0.15, 0.5, 0, 0.3, 0.05], dtype=torch.float64), atol=4e-3, rtol=0)
    edge = torch.tensor([0.0, 1.0 - 2**-52], dtype=torch.float64)  # the extremes of [0, 1): the first and last kept token
    assert sample_next(logits[:2], 1.0, 0.7, edge).tolist() == [1, 3]
    assert sample_next(logits[:2], 1.0, 1.0, edge).tolist() == [0, 4]  # no top-p: vocabulary order
    assert sample_next(logits[:2], 0.0, 0.7, None).tolist() == [1, 1]


def test_a_longer_budget_keeps_the_tokens_of_a_shorter_one(looplm):
    short = generate(looplm, [[3, 4, 5]], n=3, temperature=1.0, top_p=0.7, max_new_tokens=4, seed=7)
    longer = generate(looplm, [[3, 4, 5]], n=3, temperature=1.0, top_p=0.7, max_new_tokens=9, seed=7)
    assert [s[:4] for s in longer.sequences[0]] == short.sequences[0]


def test_eos_and_stop_end_a_sample(looplm):
    prompt = [3, 4, 5]
    free = generate(looplm, [prompt], temperature=0, max_new_tokens=6).sequences[0][0]
    eos = generate(looplm, [prompt], temperature=0, max_new_tokens=6, eos_token_id=free[2])
    assert eos.sequences[0][0] == free[: free.index(free[2]) + 1] and eos.finish_reasons[0][0] == "stop"
    stop = generate(looplm, [prompt], temperature=0, max_new_tokens=6, stop=[free[1:3]])
    assert stop.sequences[0][0][-2:] == free[1:3]


def test_ouro_checkpoint_round_trip(looplm, ids, tmp_path):
    looplm.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "ouro" and config["total_ut_steps"] == looplm.config.total_ut_steps
    with safe_open(str(next(tmp_path.glob("*.safetensors"))), "pt") as f:
        keys = set(f.keys())
    N = looplm.config.num_hidden_layers
    expected = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
                "model.early_exit_gate.weight", "model.early_exit_gate.bias"}
    for i in range(N):
        p = f"model.layers.{i}."
        expected |= {p + f"self_attn.{x}_proj.weight" for x in "qkvo"}
        expected |= {p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")}
        expected |= {p + f"{x}.weight" for x in ("input_layernorm", "input_layernorm_2",
                                                  "post_attention_layernorm", "post_attention_layernorm_2")}
    assert keys == expected
    # a real Ouro config carries remote-code and unused fields: accepted and ignored
    config.update(auto_map={"AutoModelForCausalLM": "modeling_ouro.OuroForCausalLM"},
                  layer_types=["full_attention"] * N, sliding_window=None, early_exit_threshold=1.0,
                  torch_dtype="float32")
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = load_looped(tmp_path)
    assert type(loaded) is LoopLMForCausalLM
    assert all(torch.equal(v, looplm.state_dict()[k]) for k, v in loaded.state_dict().items())
    torch.testing.assert_close(loaded(ids).logits, looplm(ids).logits, atol=ATOL, rtol=0)


def test_melt_round_trip_through_auto_classes(looplm, ids, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    model = melt(looplm, "scalar", seed=3)
    model.save_pretrained(tmp_path)
    assert AutoConfig.from_pretrained(tmp_path).gate == "scalar"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(loaded) is MeltForCausalLM
    # exact weights; logits agree to float32 kernel noise (BLAS paths depend on buffer alignment)
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits, atol=ATOL, rtol=0)


def test_gate_init_is_seeded(looplm):
    a, b, c = melt(looplm, "elementwise", 0), melt(looplm, "elementwise", 0), melt(looplm, "elementwise", 1)
    pa, pb, pc = (torch.cat([p.flatten() for p in m.gate_parameters()]) for m in (a, b, c))
    assert torch.equal(pa, pb) and not torch.equal(pa, pc)
    assert 0.015 < pa.std().item() < 0.025


@pytest.mark.parametrize("gate", ["elementwise", "scalar"])
def test_gate_init_draws_each_checkpoint_tensor_in_turn(looplm, gate):
    """The merged [W_z | U_z] starts as the two products' weights drawn one after the other did (after b_z, as
    before the merge), so a seed gives the same MELT whichever way the model holds them."""
    model = melt(looplm, gate, 3)
    generator = torch.Generator().manual_seed(3)
    d, out = looplm.config.hidden_size, looplm.config.hidden_size if gate == "elementwise" else 1
    for layer in model.model.layers:
        b_z, w_z, u_z = (torch.randn(shape, generator=generator) * 0.02 for shape in ((out,), (out, d), (out, d)))
        assert torch.equal(layer.melt_gate.ah_proj.weight, torch.cat([w_z, u_z], dim=1))
        assert torch.equal(layer.melt_gate.bias, b_z)
        a, h = torch.randn(2, 3, d), torch.randn(2, 3, d)
        torch.testing.assert_close(layer.melt_gate.logits(h, a), a @ w_z.T + h @ u_z.T + b_z, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["ouro", "melt"])
def test_checkpoints_keep_the_projections_apart_and_load_into_the_merged_weights(looplm, tmp_path, kind):
    """The model holds k|v, gate|up and MELT's W_z|U_z as one weight each; what it writes and reads is the Hub's
    layout (k_proj, v_proj, gate_proj, up_proj, a_proj, h_proj), and a save and a load give back every tensor and
    the same logits."""
    from safetensors.torch import load_file

    model = looplm if kind == "ouro" else MeltForCausalLM.from_looplm(looplm, seed=0).eval()
    model.save_pretrained(tmp_path)
    saved = load_file(next(tmp_path.glob("*.safetensors")))
    assert not any("kv_proj" in k or "gate_up_proj" in k for k in saved)
    cfg, attn, mlp = model.config, model.model.layers[1].self_attn, model.model.layers[1].mlp
    k, v = attn.kv_proj.weight.chunk(2)
    gate, up = mlp.gate_up_proj.weight.chunk(2)
    assert k.shape == (cfg.num_key_value_heads * cfg.head_dim, cfg.hidden_size) and gate.shape == (cfg.intermediate_size, cfg.hidden_size)
    for name, want in (("self_attn.k_proj", k), ("self_attn.v_proj", v), ("mlp.gate_proj", gate), ("mlp.up_proj", up)):
        assert torch.equal(saved[f"model.layers.1.{name}.weight"], want), name
    if kind == "melt":  # W_z|U_z side by side along the input: a_proj's columns, then h_proj's
        assert not any("ah_proj" in k for k in saved)
        w_z, u_z = model.model.layers[1].melt_gate.ah_proj.weight.chunk(2, dim=1)
        assert w_z.shape == (cfg.hidden_size, cfg.hidden_size)
        assert torch.equal(saved["model.layers.1.melt_gate.a_proj.weight"], w_z)
        assert torch.equal(saved["model.layers.1.melt_gate.h_proj.weight"], u_z)
    loaded = load_looped(tmp_path)
    assert loaded.state_dict().keys() == model.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))
    ids = torch.arange(3, 14)[None]
    # equal weights; BLAS may take another path for the loaded tensors' memory (the last bits, as before the merge)
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)


def test_broken_checkpoints_name_the_tensors(looplm, tmp_path):
    from safetensors.torch import load_file, save_file

    looplm.save_pretrained(tmp_path)
    shard = next(tmp_path.glob("*.safetensors"))
    tensors = load_file(shard)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(UserError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_looped(tmp_path)
    # a pair the model holds as one weight (gate_proj/up_proj) is checked before loading merges it
    tensors = load_file(shard) | {"model.layers.1.mlp.up_proj.weight": torch.zeros(3, 3)}
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(UserError, match=r"shape mismatches: model\.layers\.1\.mlp\.gate_proj\.weight \[\d+, \d+\] vs "
                                        r"model\.layers\.1\.mlp\.up_proj\.weight \[3, 3\]"):
        load_looped(tmp_path)
    tensors["model.layers.1.mlp.up_proj.weight"] = tensors["model.layers.1.mlp.gate_proj.weight"].clone()
    tensors["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(7, 7)
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(UserError, match=r"q_proj"):
        load_looped(tmp_path)


def test_unknown_gate_lists_valid_ones():
    with pytest.raises(ValueError, match="elementwise, scalar, ema, mean, last, first"):
        MeltConfig(gate="sigmoid")


def test_gate_parameter_count_of_the_paper_config():
    """MELT-1.6B = Ouro-1.4B + 201,375,744 gate parameters, counted on the meta device."""
    config = MeltConfig(**{k: v for k, v in LoopLMConfig().to_dict().items() if k not in ("model_type",)})
    with torch.device("meta"):
        model = MeltForCausalLM(config)
    assert sum(p.numel() for p in model.gate_parameters()) == 201_375_744
    total = sum(p.numel() for p in model.parameters())
    assert abs((total - 201_375_744) / 1e9 - 1.4345) < 5e-4  # Ouro-1.4B: 1.4345e9 parameters (docs/method.md#gates)


def test_registry_models_load_offline():
    for name, cls in (("tiny-random-ouro", LoopLMForCausalLM), ("tiny-random-melt", MeltForCausalLM)):
        model, tok = load_model(name)
        assert type(model) is cls and model.config.head_dim == 64
        text = tok.apply_chat_template([{"role": "user", "content": "1+1?"}], tokenize=False, add_generation_prompt=True)
        assert text.endswith("<|im_start|>assistant\n")
    model, _ = load_model("tiny-random-llama")
    assert model.config.model_type == "llama"
    with pytest.raises(UserError, match="known models: melt-1.6b"):
        load_model("gpt-17")


def test_tiny_models_are_deterministic(tmp_path):
    from melt_eval.modeling.tiny import build_tiny_model

    a, b = build_tiny_model("tiny-random-melt", tmp_path / "a"), build_tiny_model("tiny-random-melt", tmp_path / "b")
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()



def test_a_second_concurrent_build_keeps_the_first_in_place_and_replaces_a_damaged_one(tmp_path, monkeypatch):
    """Two processes building the same tiny model in a fresh MELT_EVAL_HOME at once: both saw no build, so both
    build. The one that finishes second used to delete the first one's directory (which that process, or a third,
    may already be loading) and rename its own in; it keeps the first now. A damaged build is still replaced."""
    from melt_eval.modeling import tiny

    first = tiny.build_tiny_model("tiny-random-ouro", tmp_path)
    inode = first.stat().st_ino
    held = (first / "model.safetensors").open("rb")  # what the first builder reads meanwhile
    real, looks = tiny._intact, []

    def intact(target):  # the second builder's first look found nothing: the first had not renamed yet
        looks.append(target)
        return False if len(looks) == 1 else real(target)

    monkeypatch.setattr(tiny, "_intact", intact)
    assert tiny.build_tiny_model("tiny-random-ouro", tmp_path) == first
    assert first.stat().st_ino == inode and (first / "model.safetensors").is_file()
    held.close()
    assert [p.name for p in tmp_path.iterdir()] == ["tiny-random-ouro"]  # no temporary directory left

    monkeypatch.setattr(tiny, "_intact", real)
    (first / "model.safetensors").write_bytes(b"cut")
    assert tiny.build_tiny_model("tiny-random-ouro", tmp_path) == first
    assert tiny._intact(first) and [p.name for p in tmp_path.iterdir()] == ["tiny-random-ouro"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_generation_matches_cpu(looplm, dtype):
    m = melt(looplm, "elementwise").to(dtype)
    cpu = generate(m, [[1, 2, 3, 4]], temperature=0, max_new_tokens=8)
    gpu = generate(m.cuda(), [[1, 2, 3, 4]], temperature=0, max_new_tokens=8)
    agree = sum(a == b for a, b in zip(cpu.sequences[0][0], gpu.sequences[0][0]))
    assert agree >= (8 if dtype == torch.float32 else 4)
    assert gpu.peak_cache_bytes == cpu.peak_cache_bytes
