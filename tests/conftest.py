"""Shared test setup: an isolated model cache and offline Hugging Face libraries."""

import os
import tempfile
from pathlib import Path

import pytest

# Set before anything imports huggingface_hub, so every test (and every CLI subprocess it
# starts) is offline and builds tiny models into a throw-away cache.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("MELT_EVAL_HOME", tempfile.mkdtemp(prefix="melt-eval-test-home-"))

REPO = Path(__file__).resolve().parents[1]
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
