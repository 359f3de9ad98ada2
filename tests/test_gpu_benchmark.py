"""benchmarks/gpu.py, the script a lent GPU runs, kept runnable: its --quick mode takes the GPU's code path
(bf16 autocast, the paper recipe, the compiled layer step, the engine's eager and captured decode steps) at tiny
shapes on the CPU, each measure in its own process."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu.py"


def run(tmp_path, *args) -> dict:
    out = tmp_path / "gpu.json"
    # a generous budget: --quick gives every measure what is left of it, and a shared 2-core machine is slow
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--device", "cpu", "--json", str(out),
                           "--budget-s", "900", *args], capture_output=True, text=True, timeout=1000)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "measure" in proc.stdout  # the printed table
    return json.loads(out.read_text())


def test_every_measure_runs_at_tiny_shapes_and_reports_its_figures(tmp_path):
    doc = run(tmp_path)
    assert {"device", "versions", "started", "load_avg_start", "load_avg_end", "total_s", "aims", "shapes"} <= set(doc)
    assert {"torch", "cuda", "python", "code"} <= set(doc["versions"])
    m = doc["measures"]
    assert list(m) == ["phase1_step", "decode", "decode_graphed", "chunk_overhead", "phase1_step_compiled"]
    for name, measure in m.items():
        assert measure["status"] == "done", (name, measure)
        assert measure["seconds"] > 0
    # each measure in a process of its own, none the parent's (the first H100 run leaked 75 GB between measures)
    pids = [measure["pid"] for measure in m.values()]
    assert len(set(pids)) == len(pids) and os.getpid() not in pids
    for key in ("phase1_step", "phase1_step_compiled"):
        p1 = m[key]
        for row in (p1["chunked"], p1["parallel"]):
            assert row["tokens_per_s"] > 0 and row["loss"] > 0 and row["timed_steps"] >= 2
        assert p1["chunked"]["chunks"] > 1 and p1["parallel"]["chunks"] == 1
        assert p1["chunked_vs_parallel"] > 0 and p1["vs_paper_tokens_per_s_per_gpu"] > 0
    # the saved-log-sum-exp attention backward against the recomputing one, on the device measured
    assert m["phase1_step"]["prefix_attention_check"] == {
        f"c={c}": {"kernel": "flash, log-sum-exp saved", "same_bits": True, "max_abs_diff": 0.0} for c in (1, 64)}
    dec = m["decode"]
    assert {(r["model"], r["context"]) for r in dec["rows"]} == {(n, c) for n in ("ouro", "melt") for c in (128, 512)}
    for r in dec["rows"]:
        assert r["measured_cache_bytes"] == r["wave"] * r["cache_bytes_per_sequence"]  # measured = the formula's
        assert r["tokens_per_s"] > 0 and r["bytes_read_per_token"] > 0 and 0 < r["bandwidth_fraction"]
    # a quarter of the cache per sequence: MELT holds 1 of Ouro's T = 4 entries per token and layer
    assert dec["capacity_ratio"] >= 3.9
    assert all(c["allocated"] for c in dec["capacity_at_longest_context"].values())
    assert dec["equal_batch"]["melt_vs_ouro_tokens_per_s"] > 0
    graphed = m["decode_graphed"]
    # Ouro at batch 1, MELT at the most rows the cache budget holds, MELT at batch 1
    assert [(r["model"], r["rows"] > 1) for r in graphed["rows"]] == [("ouro", False), ("melt", True), ("melt", False)]
    for r in graphed["rows"]:
        assert r["mode"] == "compiled" and r["context"] == 512  # the CPU compiles; CUDA also captures a graph
        assert r["step_s"] > 0 and r["compile_s"] > 0 and r["bandwidth_fraction"] > 0
    assert graphed["melt_vs_ouro_tokens_per_s_batch_1"] > 0
    ov = m["chunk_overhead"]
    assert len(ov["rows"]) >= 2 and "per_chunk_s" in ov and "fixed_s" in ov
    assert len(doc["aims"]) == 9 and all(a["met"] is None for a in doc["aims"])  # tiny shapes judge no aim


def test_the_captured_phase1_step_runs_when_named(tmp_path):
    """Named only (outside the 7-minute run): the phase-1 step with `compile_captured_step`, CUDA graphs on CUDA."""
    p1 = run(tmp_path, "--only", "phase1_step_captured")["measures"]["phase1_step_captured"]
    assert p1["status"] == "done", p1
    for row in (p1["chunked"], p1["parallel"]):
        assert row["tokens_per_s"] > 0 and row["loss"] > 0 and row["timed_steps"] >= 2
    assert p1["chunked"]["chunks"] > 1 and p1["compile_backend"] == "aot_eager"


def test_a_budget_too_short_skips_measures_and_still_writes_the_json(tmp_path):
    doc = run(tmp_path, "--budget-s", "0", "--only", "decode,chunk_overhead")
    m = doc["measures"]
    assert m["decode"]["status"] == m["chunk_overhead"]["status"] == "skipped"
    assert "time budget" in m["decode"]["reason"]
    assert m["phase1_step"]["status"] == "not run"


def test_an_out_of_memory_error_inside_the_optimiser_step_leaves_the_next_step_runnable(monkeypatch):
    """The first H100 run: an out-of-memory error inside `opt.step()` left AdamW's state half-built, and the next
    step failed with KeyError 'exp_avg_sq'. The error is caught by type, and the next attempt starts clean."""
    sys.path.insert(0, str(SCRIPT.parent))
    import gpu

    device = torch.device("cpu")
    trainer = gpu.Trainer(gpu.QUICK, device, gpu.Clock(device, 60))
    real_step = trainer.opt.step

    def failing_step(*args, **kwargs):
        group = trainer.opt.param_groups[0]["params"]
        trainer.opt.state[group[0]]["step"] = torch.tensor(0.0)  # what AdamW had built when memory ran out
        trainer.opt.state[group[0]]["exp_avg"] = torch.zeros_like(group[0])
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(trainer.opt, "step", failing_step)
    assert trainer.try_timed(64, 32, steps=1) == {"seq_len": 64, "chunk_size": 32, "oom": True}
    monkeypatch.setattr(trainer.opt, "step", real_step)
    row = trainer.try_timed(64, 32, steps=1)
    assert "oom" not in row and row["loss"] > 0


def test_other_errors_are_not_taken_for_out_of_memory(monkeypatch):
    sys.path.insert(0, str(SCRIPT.parent))
    import gpu

    device = torch.device("cpu")
    trainer = gpu.Trainer(gpu.QUICK, device, gpu.Clock(device, 60))
    monkeypatch.setattr(trainer.opt, "step", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("out of memory? no: a bug")))
    with pytest.raises(RuntimeError, match="a bug"):
        trainer.try_timed(64, 32, steps=1)


def test_fsdp_is_named_only_and_says_why_it_does_not_run_on_the_cpu(tmp_path):
    """Accelerate runs FSDP on GPUs only: the opt-in measure is outside the default run, and on the CPU it is
    skipped with its reason rather than training something else (issue 50)."""
    doc = run(tmp_path, "--only", "fsdp")
    assert list(doc["measures"]) == ["phase1_step", "decode", "decode_graphed", "chunk_overhead", "phase1_step_compiled", "fsdp"]
    fsdp = doc["measures"]["fsdp"]
    assert fsdp["status"] == "skipped" and "GPUs only" in fsdp["reason"], fsdp
    assert all(m["status"] == "not run" for name, m in doc["measures"].items() if name != "fsdp")


def test_a_failed_prefix_attention_check_times_the_step_with_the_recomputing_backward(monkeypatch):
    """A GPU runs the saved-log-sum-exp branch for the first time: if its check fails, the phase-1 measure still
    gives its figures, timed with the recomputing backward, and says so."""
    sys.path.insert(0, str(SCRIPT.parent))
    import gpu

    from melt_eval.modeling import kv_cache

    def failing(*args):
        raise RuntimeError("flash backward: wrong arguments (simulated)")

    monkeypatch.setattr(kv_cache, "_flash_backward", failing)
    monkeypatch.setattr(kv_cache, "_flash_inputs", kv_cache._flash_inputs)  # put back after the measure replaces it
    device = torch.device("cpu")
    report = gpu.Report(None, {})
    gpu.phase1(report, "phase1_step", gpu.QUICK, device, gpu.Clock(device, 300), compiled=False)
    m = report.doc["measures"]["phase1_step"]
    assert m["prefix_attention_check"]["c=1"]["error"] == "RuntimeError: flash backward: wrong arguments (simulated)"
    assert m["prefix_attention"] == "recomputed in the backward (the check failed)"
    assert m["chunked"]["tokens_per_s"] > 0 and m["chunked"]["loss"] > 0
