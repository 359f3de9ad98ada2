"""`melt-eval demo --quick` end to end: every table, the figures, and a second run that only re-renders."""

from __future__ import annotations

import json
import os

import pytest
from typer.testing import CliRunner

from melt_eval.cli import app
from melt_eval.training.config import load_recipe

TABLES = ["### Main comparison", "### Gate ablation", "### Component removal", "### Untrained KV sharing",
          "### Memory", "### Other tasks"]


@pytest.fixture(scope="module")
def quick_demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    cwd = os.getcwd()
    os.chdir(out.parent)  # a relative --output, as the default demo/ is
    try:
        res = CliRunner().invoke(app, ["demo", "--quick", "--output", out.name, "--no-progress"])
    finally:
        os.chdir(cwd)
    assert res.exit_code == 0, res.output + repr(res.exception)
    return out


def test_quick_demo_writes_every_table_and_figure(quick_demo):
    report = (quick_demo / "report" / "report.md").read_text()
    for heading in TABLES:
        assert heading in report, heading
    # the ablation tables carry the demo's own rows, evaluated on the synthetic task
    gates = report.split("### Gate ablation")[1].split("###")[0]
    assert "synthetic pass@1" in gates and "Single-gated" in gates
    kv = report.split("### Untrained KV sharing")[1].split("###")[0]
    for row in ("Last loop (w/ prefill)", "First loop"):
        assert row in kv
    tex = (quick_demo / "report" / "report.tex").read_text()
    assert "\\begin{document}" in tex and tex.count("\\begin{tabular}") == len(TABLES)
    for name in ("memory_vs_accuracy.png", "memory_vs_accuracy.pdf", "loops.png", "loops.pdf"):
        assert (quick_demo / "report" / "plots" / name).stat().st_size > 1000
    assert "Gate ablation" in (quick_demo / "report" / "paper_tables.md").read_text()
    summary = json.loads((quick_demo / "demo.json").read_text())
    assert 0.0 <= summary["teacher_pass@1"] <= 1.0


def test_every_variant_has_finished_results(quick_demo):
    results = quick_demo / "results"
    for ablation, variants in {
        "gates": ["elementwise", "scalar", "ema-0.2", "mean", "last"],
        "components": ["full", "no-align", "no-interp", "no-kd", "no-chunk"],
        "kv-sharing": ["ouro", "last-prefill", "last", "first-prefill", "first"],
    }.items():
        for v in variants:
            r = json.loads((results / "ablations" / ablation / v / "synthetic" / "results.json").read_text())
            assert r["finished"] and r["settings"]["samples"] == 16 and r["settings"]["top_p"] == 0.7
            assert r["settings"]["temperature"] == 1.0 and set(r["metrics"]) == {"pass@1", "pass@10"}
            # prompts are prefilled with the chunk the MELT runs were trained with, for every model alike
            assert r["settings"]["prefill_chunk"] == load_recipe("tiny-phase1").chunk_size
    melt = json.loads((results / "melt-tiny" / "synthetic" / "results.json").read_text())
    ouro = json.loads((results / "ouro-tiny" / "synthetic" / "results.json").read_text())
    assert ouro["peak_cache_bytes"] == 4 * melt["peak_cache_bytes"]  # same prompts, T = 4: a quarter of the cache


def test_second_run_only_re_renders(quick_demo, monkeypatch):
    import melt_eval.evaluation.lighteval_model as lm
    import melt_eval.training.runner as runner

    def refuse(*args, **kwargs):
        raise AssertionError("a finished demo must not train or generate again")

    monkeypatch.setattr(runner, "train", refuse)
    monkeypatch.setattr(lm.NativeBackend, "generate", refuse)
    before = (quick_demo / "results" / "melt-tiny" / "synthetic" / "results.json").read_text()
    # the same directory spelled another way (absolute): still the same runs and results
    res = CliRunner().invoke(app, ["demo", "--quick", "--output", str(quick_demo), "--no-progress"])
    assert res.exit_code == 0, res.output + repr(res.exception)
    assert (quick_demo / "results" / "melt-tiny" / "synthetic" / "results.json").read_text() == before


@pytest.mark.slow
def test_full_demo_teacher_reaches_half_pass_at_1(tmp_path):
    """The full demo's teacher, trained by its recipe and evaluated as the demo evaluates it, answers at
    least half of the test problems per sample (pass@1 >= 0.5): the demo's numbers rest on it (~5 min)."""
    from melt_eval import ablations, demo
    from melt_eval.evaluation import run_tasks

    teacher = ablations.train_run(demo.teacher_run(demo.FULL), tmp_path / "runs", progress=False)
    [result] = run_tasks(demo.TASK, str(teacher), results_dir=tmp_path / "results", progress=False,
                         **demo.eval_settings(demo.FULL))
    assert result["metrics"]["pass@1"]["value"] >= 0.5, result["metrics"]
