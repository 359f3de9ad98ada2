"""`melt_eval.cache_layout` is the one owner of how a model keeps its KV across loops: every layout's
entries and bytes, the one error, what vLLM is told, and the engine allocating exactly what it says."""

import re
from pathlib import Path

import pytest
import torch

from melt_eval.cache_layout import (KV_SHARING_KEY, PREFILL_CHUNK_KEY, LayoutError, cache_layout, layout_of)

PAPER = dict(loops=4, layers=24, kv_heads=16, head_dim=128)
REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("model_type,options,kind,entries", [
    ("ouro", {}, "per_loop", (4, 4)),
    ("melt", {}, "shared", (1, 1)),
    ("ouro", {"kv_sharing": "last", "share_prompt": True}, "shared", (1, 1)),
    ("ouro", {"kv_sharing": "first"}, "generated_shared", (4, 1)),
    ("llama", {}, "single", (1, 1)),
])
def test_each_layout_keeps_its_entries_per_token(model_type, options, kind, entries):
    layout = cache_layout(model_type, **PAPER, **options)
    assert layout.kind == kind and layout.entries_per_token() == entries
    prompt, generated = entries
    assert layout.nbytes(100, 7) == 2 * 24 * (prompt * 100 + generated * 7) * 16 * 128 * 2
    assert layout.prefill_chunk_matters == (kind == "shared")


def test_the_paper_figures():
    assert cache_layout("melt", **PAPER).bytes_per_token() == 196_608  # 2 x 24 x 16 x 128 x 2
    assert cache_layout("ouro", **PAPER).bytes_per_token() == 4 * 196_608


@pytest.mark.parametrize("model_type,options,message", [
    ("melt", {"kv_sharing": "last"}, "MELT always shares its KV cache"),
    ("ouro", {"kv_sharing": "middle"}, "--kv-sharing must be 'first' or 'last'"),
    ("llama", {"kv_sharing": "last"}, "apply to LoopLM (Ouro) models only"),
    ("ouro", {"share_prompt": True}, "--share-prompt goes with --kv-sharing"),
])
def test_an_invalid_combination_is_one_error(model_type, options, message):
    with pytest.raises(LayoutError, match=re.escape(message)):
        cache_layout(model_type, **PAPER, **options)


def test_what_vllm_is_told():
    assert cache_layout("melt", **PAPER).vllm_overrides(None, 4) == {PREFILL_CHUNK_KEY: 4}
    assert cache_layout("ouro", **PAPER).vllm_overrides(None, None) == {}
    shared = cache_layout("ouro", **PAPER, kv_sharing="first", share_prompt=True)
    assert shared.vllm_overrides("first", 2) == {KV_SHARING_KEY: "first", PREFILL_CHUNK_KEY: 2}
    assert (shared.vllm_caches(), cache_layout("ouro", **PAPER).vllm_caches()) == (24, 96)
    with pytest.raises(LayoutError, match="runs on --backend native only"):
        cache_layout("ouro", **PAPER, kv_sharing="first").vllm_caches()
    # a config the plugin reads carries the sharing as an override: its prompt is shared too
    config = {"model_type": "ouro", "num_attention_heads": 16, "hidden_size": 2048, "num_hidden_layers": 24,
              "total_ut_steps": 4, KV_SHARING_KEY: "last"}
    assert layout_of(config).kind == "shared" and layout_of(config).gate == "last"


@pytest.mark.parametrize("kv_sharing,share_prompt", [(None, False), ("last", True), ("first", False)])
@pytest.mark.parametrize("model", ["tiny-random-ouro", "tiny-random-melt"])
def test_the_engine_allocates_what_the_layout_counts(model, kv_sharing, share_prompt):
    from melt_eval.generation import generate
    from melt_eval.generation.options import InferenceOptions
    from melt_eval.modeling import load_model

    loaded, _ = load_model(model)
    if kv_sharing and model.endswith("melt"):
        with pytest.raises(LayoutError, match="MELT always shares"):
            generate(loaded, [[5, 6, 7]], InferenceOptions(kv_sharing=kv_sharing, share_prompt=share_prompt),
                     temperature=0.0, max_new_tokens=4)
        return
    options = InferenceOptions(kv_sharing=kv_sharing, share_prompt=share_prompt)
    res = generate(loaded, [[5, 6, 7, 8, 9]], options, n=2, temperature=0.0, max_new_tokens=4)
    layout = layout_of(loaded.config, kv_sharing=kv_sharing, share_prompt=share_prompt)
    per_value = torch.empty((), dtype=loaded.lm_head.weight.dtype).element_size()
    assert res.peak_cache_bytes == 2 * layout.nbytes(5, 4, bytes_per_value=per_value)


def test_no_other_module_decides_the_cache_layout():
    """The places that once decided for themselves (the engine, vLLM backend and plugin, serve, the report)
    ask the layout: no model-type or kv_sharing test about caches is left there."""
    decided = re.compile(r"isinstance\([^)]*Melt|model_type\s*[!=]=\s*\"(melt|ouro)\"|always shares|_shared_cache|shares_kv")
    places = [REPO / "melt_eval" / p for p in ("generation", "vllm_plugin", "report")] + [REPO / "melt_eval" / "serve.py"]
    found = []
    for place in places:
        for path in ([place] if place.is_file() else sorted(place.rglob("*.py"))):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if decided.search(line.split("#")[0]):
                    found.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert not found, "\n".join(found)


def test_vllm_runs_the_untrained_sharing_that_covers_the_prompt():
    """`run --backend vllm --kv-sharing last --share-prompt` passes the backend checks (vLLM's only form of the
    baselines); without --share-prompt the layout says to add it, before any engine starts."""
    from melt_eval.generation.backends import BackendSettings, check_backend_settings
    from melt_eval.generation.options import InferenceOptions

    check_backend_settings(InferenceOptions(kv_sharing="last", share_prompt=True), BackendSettings(kind="vllm"))
    layout = cache_layout("ouro", **PAPER, kv_sharing="last")
    with pytest.raises(LayoutError, match=r"\(--share-prompt\)"):
        layout.vllm_caches()
