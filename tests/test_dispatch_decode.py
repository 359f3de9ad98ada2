"""benchmarks/dispatch_decode.py pins the decode token step's kernel ops (exact counts, not timings): the host issues
each op on a GPU, so more ops is a slower step at any batch (issue 49: 147 ms a step at 32K against 12 ms of bytes)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


@pytest.fixture(scope="module")
def counts(tmp_path_factory):
    import dispatch_decode

    return dispatch_decode.main(["--json", str(tmp_path_factory.mktemp("dispatch") / "decode.json")])["models"]


# Issue 49's aims: eager <= 45 ops per (layer, loop) on a GPU, compiled <= 12 launches, no graph break or recompile.
# Eager on the CPU, RMSNorm is 8 ops however it is written (F.rms_norm decomposes here), one fused kernel on CUDA:
# the CPU count is pinned as reached (7111383: 59 Ouro, 65.75 MELT) and the count with fused norms carries the aim.
# Compiled, the engine's model (which trains nothing) has its weights frozen in, and inductor merges q|k|v and
# gate|up: 4 and 5.75 GEMMs per (layer, loop) instead of 7 and 8.5 (docs/results/2026-11-28-dispatch.md). MELT's
# gate reads [a_t, h_{t-1}] through one product since issue 49's eighth pass: one op fewer eager, one GEMM more
# compiled (inductor had merged W_z into q's GEMM, which reads a_t too), at three loops of four
# (docs/results/2026-11-29-dispatch.md#eighth-pass).
# Inductor writes AVX2 code on the pinned float path (ATEN_CPU_CAPABILITY=avx2, melt_eval/float_path.py) on every
# machine, and there MELT's step counts 13.5 launches, not the 11.25 of AVX-512 code (measured 2026-12-07): the
# CPU count is pinned as the pinned path gives it; issue 49's aim of 12 is about a GPU's launches.
EAGER = {"ouro": 48, "melt": 51.75}
COMPILED = {"ouro": 9, "melt": 13.5}
GPU_AIM = 12


@pytest.mark.slow  # inductor compiles four tiny models (a few minutes on a loaded 2-core machine)
@pytest.mark.parametrize("kind", ["ouro", "melt"])
def test_the_decode_step_stays_within_its_op_budgets(counts, kind):
    eager, captured, compiled, stable = (counts[kind][k] for k in ("eager", "captured_eager", "compiled", "stability"))
    assert eager["per_layer_loop"]["ops"] <= EAGER[kind]
    assert eager["per_layer_loop"]["norm_ops"] == 32  # 4 norms x 8 ops: what F.rms_norm fuses on CUDA
    assert eager["per_layer_loop"]["fused_norms"] <= 45
    # the captured step's device-side addressing costs nothing per (layer, loop): its ops are the eager step's
    assert captured["per_layer_loop"] == eager["per_layer_loop"]
    assert 0 < compiled["per_layer_loop"] <= COMPILED[kind]
    if kind == "ouro":
        assert compiled["per_layer_loop"] <= GPU_AIM
    # the count did read inductor's code: its matrix products, as a plain GEMM or (frozen weights on the CPU)
    # oneDNN's prepacked linear
    gemms = ("extern_kernels.mm", "torch.ops.mkldnn._linear_pointwise.default")
    assert sum(compiled["extern_at_2_layers"].get(name, 0) for name in gemms) > 0, compiled["extern_at_2_layers"]
    assert stable["positions"] >= 64 and stable["graph_breaks"] == 0 and stable["recompiles"] == 0
    assert stable["frames_compiled"] == 1
