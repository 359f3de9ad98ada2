"""benchmarks/gpu.py, the script a lent GPU runs, kept runnable: its --quick mode takes the GPU's code path
(bf16 autocast, the paper recipe, the compiled layer step, the engine's decode step) at tiny shapes on the CPU."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu.py"


def run(tmp_path, *args) -> dict:
    out = tmp_path / "gpu.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--device", "cpu", "--json", str(out), *args],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "measure" in proc.stdout  # the printed table
    return json.loads(out.read_text())


def test_every_measure_runs_at_tiny_shapes_and_reports_its_figures(tmp_path):
    doc = run(tmp_path)
    assert {"device", "versions", "started", "load_avg_start", "load_avg_end", "total_s", "aims", "shapes"} <= set(doc)
    assert {"torch", "cuda", "python", "code"} <= set(doc["versions"])
    m = doc["measures"]
    assert list(m) == ["phase1_step", "decode", "chunk_overhead", "phase1_step_compiled"]
    for name, measure in m.items():
        assert measure["status"] == "done", (name, measure)
        assert measure["seconds"] > 0
    for key in ("phase1_step", "phase1_step_compiled"):
        p1 = m[key]
        for row in (p1["chunked"], p1["parallel"]):
            assert row["tokens_per_s"] > 0 and row["loss"] > 0 and row["timed_steps"] >= 2
        assert p1["chunked"]["chunks"] > 1 and p1["parallel"]["chunks"] == 1
        assert p1["chunked_vs_parallel"] > 0 and p1["vs_paper_tokens_per_s_per_gpu"] > 0
    dec = m["decode"]
    assert {(r["model"], r["context"]) for r in dec["rows"]} == {(n, c) for n in ("ouro", "melt") for c in (128, 512)}
    for r in dec["rows"]:
        assert r["measured_cache_bytes"] == r["wave"] * r["cache_bytes_per_sequence"]  # measured = the formula's
        assert r["tokens_per_s"] > 0 and r["bytes_read_per_token"] > 0 and 0 < r["bandwidth_fraction"]
    # a quarter of the cache per sequence: MELT holds 1 of Ouro's T = 4 entries per token and layer
    assert dec["capacity_ratio"] >= 3.9
    assert all(c["allocated"] for c in dec["capacity_at_longest_context"].values())
    assert dec["equal_batch"]["melt_vs_ouro_tokens_per_s"] > 0
    ov = m["chunk_overhead"]
    assert len(ov["rows"]) >= 2 and "per_chunk_s" in ov and "fixed_s" in ov
    assert len(doc["aims"]) == 6 and all(a["met"] is None for a in doc["aims"])  # tiny shapes judge no aim


def test_a_budget_too_short_skips_measures_and_still_writes_the_json(tmp_path):
    doc = run(tmp_path, "--budget-s", "0", "--only", "decode,chunk_overhead")
    m = doc["measures"]
    assert m["decode"]["status"] == m["chunk_overhead"]["status"] == "skipped"
    assert "time budget" in m["decode"]["reason"]
    assert m["phase1_step"]["status"] == "not run"
