"""Memory you can predict: the native engine's cache budget, waves, and the requests it refuses."""

import math

import pytest
import torch

from melt_eval.errors import UserError
from melt_eval.generation import generate
from melt_eval.generation import engine
from melt_eval.generation.engine import (
    GenerationRequestError,
    cache_bytes_per_row,
    default_cache_budget,
    plan_waves,
)
from melt_eval.generation.options import InferenceOptions
from melt_eval.modeling import LoopLMConfig, LoopLMForCausalLM, MeltConfig, MeltForCausalLM
from melt_eval.units import parse_bytes

from helpers import main_exit_code as _main

PROMPTS = [[3, 4, 5, 6, 7], [9, 10], [11, 12, 13]]


@pytest.fixture(scope="module")
def looplm(random_looplm):
    return random_looplm(0.08, num_hidden_layers=2, num_attention_heads=2, head_dim=32)  # samples differ between rows


@pytest.fixture(scope="module")
def melt(looplm):
    return MeltForCausalLM.from_looplm(looplm, gate="elementwise", seed=0).eval()


VARIANTS = {  # model fixture, kv_sharing, share_prompt
    "ouro": ("looplm", None, False),
    "melt": ("melt", None, False),
    "ouro-kv-last-w-prefill": ("looplm", "last", False),
    "ouro-kv-first-shared-prompt": ("looplm", "first", True),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_waves_give_the_same_samples_as_one_wave(request, variant):
    fixture, kv_sharing, share_prompt = VARIANTS[variant]
    model = request.getfixturevalue(fixture)
    options = InferenceOptions(kv_sharing=kv_sharing, share_prompt=share_prompt)
    kw = dict(n=3, temperature=1.0, top_p=0.9, max_new_tokens=5, seed=[5, 6, 7])
    whole = generate(model, PROMPTS, options, max_cache_bytes=1 << 40, **kw)
    per_row = cache_bytes_per_row(model, 5, 5, kv_sharing=kv_sharing, share_prompt=share_prompt)
    assert whole.peak_cache_bytes == 9 * per_row  # the formula is what _Caches allocates, one wave of 9 rows
    # 2 rows a wave: 5 waves, every prompt's samples split between two waves
    waves = generate(model, PROMPTS, options, max_cache_bytes=2 * per_row + 1, **kw)
    assert waves.sequences == whole.sequences
    # a different batch size may change the last bits of a matmul, never a sampled token
    assert [[pytest.approx(lp, abs=1e-4) for lp in per] for per in waves.logprobs] == whole.logprobs
    assert waves.finish_reasons == whole.finish_reasons
    assert waves.peak_cache_bytes == 2 * per_row
    assert len({tuple(s) for per in whole.sequences for s in per}) > 3  # rows really differ
    if variant == "melt":
        one = generate(model, PROMPTS, options, max_cache_bytes=per_row, **kw)  # one row at a time
        assert one.sequences == whole.sequences and one.peak_cache_bytes == per_row


def test_waves_count_tokens_through_the_callback(looplm):
    seen = []
    res = generate(looplm, PROMPTS, n=2, max_new_tokens=4, seed=1,
                   max_cache_bytes=3 * cache_bytes_per_row(looplm, 5, 4), callback=seen.append)
    assert sum(seen) == res.num_generated_tokens == sum(len(s) for per in res.sequences for s in per)


def _real_size(cls, config_cls):
    """A model with the paper's dimensions (24 layers, d 2048, 16 KV heads x 128, T = 4) on the meta
    device: plan_waves needs shapes only, so nothing is allocated."""
    with torch.device("meta"):
        model = cls(config_cls())
    return model.to(torch.bfloat16)


def test_paper_defaults_on_a_real_size_model_run_in_waves():
    melt = _real_size(MeltForCausalLM, MeltConfig)
    ouro = _real_size(LoopLMForCausalLM, LoopLMConfig)
    budget = 70 * 2**30  # what an 80 GB GPU has left after the weights
    rows = 16  # 16 samples of one problem, 32,768 new tokens each, a 300-token prompt
    melt_row = cache_bytes_per_row(melt, 300, 32768)
    assert melt_row == 24 * (300 + 32768) * 2 * 16 * 128 * 2  # N entries per token (bf16 K and V)
    assert rows * melt_row > 100 * 10**9  # what the one-wave engine asked for (~103 GB)
    per_wave = plan_waves(melt, prompt_tokens=300, max_new_tokens=32768, rows=rows, max_cache_bytes=budget)
    assert 1 <= per_wave < rows and per_wave * melt_row <= budget
    ouro_row = cache_bytes_per_row(ouro, 300, 32768)
    assert ouro_row == 4 * melt_row  # Ouro keeps T = 4 entries per layer and token
    ouro_wave = plan_waves(ouro, prompt_tokens=300, max_new_tokens=32768, rows=rows, max_cache_bytes=budget)
    assert 1 <= ouro_wave < per_wave and ouro_wave * ouro_row <= budget


def test_more_loops_than_the_config_is_allowed_while_its_cache_fits():
    melt = _real_size(MeltForCausalLM, MeltConfig)
    melt.config.total_ut_steps = 1_000_000  # MELT's cache does not grow with T
    assert plan_waves(melt, prompt_tokens=100, max_new_tokens=1000, rows=4, max_cache_bytes=2**30) == 4
    ouro = _real_size(LoopLMForCausalLM, LoopLMConfig)
    ouro.config.total_ut_steps = 8
    assert plan_waves(ouro, prompt_tokens=100, max_new_tokens=1000, rows=4, max_cache_bytes=4 * 2**30) >= 1
    ouro.config.total_ut_steps = 1_000_000
    with pytest.raises(GenerationRequestError, match=r"1000000 loops x 24 layers.*--loops"):
        plan_waves(ouro, prompt_tokens=100, max_new_tokens=1000, rows=4, max_cache_bytes=2**30)


@pytest.fixture
def no_allocation(monkeypatch):
    """Fails the test if the engine allocates a cache."""

    def refuse(*args, **kwargs):
        raise AssertionError("a cache was allocated for a request that should have been refused")

    monkeypatch.setattr(engine._Caches, "__init__", refuse)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(temperature=math.nan), "temperature must be a finite number"),
        (dict(temperature=math.inf), "temperature must be a finite number"),
        (dict(temperature=-0.5), "got -0.5"),
        (dict(top_p=0.0), "top_p must be in (0, 1]"),
        (dict(top_p=1.5), "got 1.5"),
        (dict(top_p=math.nan), "top_p must be in (0, 1]"),
        (dict(max_new_tokens=0), "max_new_tokens must be a whole number >= 1"),
        (dict(max_new_tokens=2.5), "got 2.5"),
        (dict(max_new_tokens=10**12), "max_new_tokens 1000000000000 = 1000000000005 positions"),
        (dict(n=0), "samples must be a whole number"),
        (dict(max_cache_bytes=1000), "more than the cache budget of 1000 B"),
    ],
)
def test_impossible_requests_are_refused_before_any_allocation(looplm, no_allocation, kwargs, message):
    kw = {**dict(n=2, temperature=1.0, top_p=1.0, max_new_tokens=4, seed=0), **kwargs}
    with pytest.raises(GenerationRequestError) as exc:
        generate(looplm, [[3, 4, 5, 6, 7]], **kw)
    assert message in str(exc.value) and isinstance(exc.value, UserError) and "\n" not in str(exc.value)


def test_absurd_loop_count_is_refused_before_any_allocation(looplm, no_allocation):
    looplm.config.total_ut_steps = 1_000_000
    try:
        with pytest.raises(GenerationRequestError, match="1000000 loops x 2 layers"):
            generate(looplm, [[3, 4, 5]], max_new_tokens=8, max_cache_bytes=2**30)
    finally:
        looplm.config.total_ut_steps = 4


def test_positions_beyond_the_model_need_an_explicit_option(looplm):
    limit = looplm.config.max_position_embeddings
    prompt = list(range(3, 13))
    looplm.config.max_position_embeddings = 12
    try:
        with pytest.raises(GenerationRequestError, match="10-token prompt .* beyond the model's max_position_embeddings 12"):
            generate(looplm, [prompt], temperature=0, max_new_tokens=4)
        res = generate(looplm, [prompt], temperature=0, max_new_tokens=4, allow_beyond_max_positions=True)
        assert len(res.sequences[0][0]) == 4
    finally:
        looplm.config.max_position_embeddings = limit


def test_default_budget_is_a_share_of_free_memory():
    free = engine.free_device_bytes("cpu")
    budget = default_cache_budget("cpu")
    assert 0 < budget <= free


@pytest.mark.parametrize("text, value", [("1000", 1000), ("512MiB", 512 * 2**20), ("40GB", 40 * 10**9),
                                         ("1.5GiB", int(1.5 * 2**30)), ("2 g", 2 * 2**30)])
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["lots", "-5", "0", "nan", "inf", "3 parsecs"])
def test_parse_bytes_refuses_what_is_not_a_size(text):
    with pytest.raises(UserError, match="--max-cache-bytes"):
        parse_bytes(text)




@pytest.mark.parametrize(
    "args, message",
    [
        (["--loops", "1000000"], "1000000 loops x 2 layers"),
        (["--max-new-tokens", "1000000000000"], "--max-new-tokens 1000000000000 need at least"),  # host memory, checked first
        (["--max-new-tokens", "5000"], "beyond the model's max_position_embeddings 4096"),
        (["--temperature", "nan"], "--temperature must be a finite number"),
        (["--temperature", "inf"], "--temperature must be a finite number"),
        (["--temperature", "-1"], "--temperature must be a finite number"),
        (["--top-p", "nan"], "--top-p must be in (0, 1]"),
        (["--max-cache-bytes", "1KiB"], "more than the cache budget of 1.0 KiB"),
        (["--max-cache-bytes", "lots"], "--max-cache-bytes 'lots' is not a size"),
    ],
)
def test_run_refuses_impossible_requests_in_one_line_before_writing(tmp_path, capsys, args, message):
    out = tmp_path / "out"
    code = _main(["run", "synthetic", "--model", "tiny-random-ouro", "--max-problems", "2", "--samples", "2",
                  "--output", str(out), "--no-progress", *args])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and message in err, err
    assert not out.exists()


def test_run_with_a_tiny_budget_matches_the_default(tmp_path):
    from melt_eval.evaluation import BackendSettings, RunPaths, run_tasks
    from melt_eval.generation.options import InferenceOptions, Sampling

    options = InferenceOptions(sampling=Sampling(samples=2, max_new_tokens=8))
    kw = dict(max_problems=2, progress=False)
    [free] = run_tasks("synthetic", "tiny-random-melt", options, RunPaths(output=tmp_path / "a"), **kw)
    per_row = cache_bytes_per_row(_tiny_melt(), 64, 8)  # the prompts are shorter: one or two rows a wave
    [tight] = run_tasks("synthetic", "tiny-random-melt", options, RunPaths(output=tmp_path / "b"),
                       backend=BackendSettings(max_cache_bytes=per_row), **kw)
    a = (tmp_path / "a" / "tiny-random-melt" / "synthetic" / "details.jsonl").read_text()
    b = (tmp_path / "b" / "tiny-random-melt" / "synthetic" / "details.jsonl").read_text()
    assert a == b and free["metrics"] == tight["metrics"]
    assert tight["peak_cache_bytes"] < free["peak_cache_bytes"]


def _tiny_melt():
    from melt_eval.modeling import load_model

    return load_model("tiny-random-melt")[0]


def test_a_prompt_longer_than_the_model_is_a_one_line_error_in_a_run(tmp_path, capsys):
    import json

    (tmp_path / "data").mkdir()
    rows = [{"problem": "1+1", "answer": "2"}, {"problem": "1+1 " * 3000, "answer": "2"}]
    (tmp_path / "data" / "aime24.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    code = _main(["run", "aime24", "--model", "tiny-random-melt", "--data-dir", str(tmp_path / "data"),
                  "--output", str(out), "--samples", "2", "--max-new-tokens", "4", "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "max_position_embeddings 4096" in err, err
    assert "shorten the problem" in err
