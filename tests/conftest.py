"""Shared test setup: an isolated model cache and offline Hugging Face libraries."""

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

# Set before anything imports huggingface_hub, so every test (and every CLI subprocess it
# starts) is offline and builds tiny models into a throw-away cache.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# The README runs the tests in two worker processes on two cores, each pinned to 2 torch threads: an OpenMP thread
# that waits sleeps rather than spins, so that the other worker's threads get the core. The wait policy decides
# how idle threads wait, not what they compute, so the bits are the same.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
if "MELT_EVAL_HOME" not in os.environ:  # a throw-away home, removed when the session ends
    os.environ["MELT_EVAL_HOME"] = tempfile.mkdtemp(prefix="melt-eval-test-home-")
    atexit.register(shutil.rmtree, os.environ["MELT_EVAL_HOME"], ignore_errors=True)

# The float path every command pins (melt_eval/float_path.py), set before torch loads, so that tests calling the
# library in this process compute as the commands they start do.
from melt_eval import float_path  # noqa: E402  (imports no torch)

float_path.pin()

REPO = Path(__file__).resolve().parents[1]


def pytest_addoption(parser):
    parser.addoption("--demo-scale", action="store_true",
                     help="also run the tests that train the full demo's models (tens of minutes on 2 cores)")


def pytest_collection_modifyitems(config, items):
    """`demo_scale` tests reproduce a published figure of the full demo: their time is on a results page, not in
    the default run (docs/results/2026-12-07-float-path.md); `--demo-scale` runs them."""
    if config.getoption("--demo-scale"):
        return
    skip = pytest.mark.skip(reason="trains the full demo's models: pass --demo-scale")
    for item in items:
        if "demo_scale" in item.keywords:
            item.add_marker(skip)
SHARED_BENCHMARKS = REPO.parent / "shared" / "benchmarks"


@pytest.fixture(scope="session")
def shared_benchmarks() -> Path:
    """The real benchmark copies beside the checkout; tests using them skip when absent."""
    if not SHARED_BENCHMARKS.is_dir():
        pytest.skip("../shared/benchmarks is not present")
    return SHARED_BENCHMARKS


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: a second intra-op thread only adds spin-waiting on a shared 2-core box."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def random_looplm():
    """make(std, dtype=float32, **dims): a tiny LoopLM (the tiny tokenizer, seed 0) whose weight matrices are
    redrawn from N(0, std), larger than the 0.02 init, so that loops, gates and rows really differ."""
    import torch

    from melt_eval.modeling.tiny import build_tokenizer, make_tiny_looplm

    def make(std: float, dtype=torch.float32, **dims):
        model = make_tiny_looplm(build_tokenizer(), **dims).to(dtype)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 2:
                    p.normal_(0, std)
        return model.eval()

    return make


@pytest.fixture(scope="session")
def training_batch():
    """make(length, pad_from, loss_from): two rows of random ids (seed 0); row 1 is right-padded from
    `pad_from`; the loss covers row 0 from loss_from[0] to its end and row 1 from loss_from[1] to its padding."""
    import torch

    def make(length: int, pad_from: int, loss_from: tuple[int, int]) -> dict:
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(5, 500, (2, length), generator=g)
        attn = torch.ones(2, length, dtype=torch.bool)
        attn[1, pad_from:] = False
        loss = torch.zeros(2, length, dtype=torch.bool)
        loss[0, loss_from[0]:] = True
        loss[1, loss_from[1]:pad_from] = True
        return {"input_ids": ids, "attention_mask": attn, "loss_mask": loss}

    return make


@pytest.fixture(scope="module")
def chunk_looplm(random_looplm):
    """The float64 LoopLM the chunk-wise training paths are checked on against their references (grouped-query,
    3 loops): float64 so that two orders of the same sums agree to 1e-9."""
    import torch

    return random_looplm(0.1, torch.float64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, hidden_size=64, intermediate_size=96, loops=3)


@pytest.fixture(scope="module")
def tiny_dirs():
    """The tiny checkpoints the loading tests copy and damage: Ouro, MELT and a plain Llama."""
    from melt_eval.modeling.loading import resolve_model_dir

    return {name: resolve_model_dir(name) for name in ("tiny-random-ouro", "tiny-random-melt", "tiny-random-llama")}
