"""`melt-eval memory`: the figures of docs/method.md#caches (the paper's memory table), exactly, and the paper's beside them."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import types

import pytest
from typer.testing import CliRunner

from melt_eval.cli import app
from melt_eval.report.latex import standalone
from melt_eval.report.memory import as_table, memory_table, paper_notes
from melt_eval.report.render import render_latex

runner = CliRunner()
PAPER_ROWS = ["melt-1.6b", "ouro-1.4b-thinking", "qwen3-1.7b"]


def memory_json(*args: str) -> dict[str, dict]:
    res = runner.invoke(app, ["memory", "--format", "json", *args])
    assert res.exit_code == 0, res.output
    return {r["model"]: r for r in json.loads(res.output)}


def test_kv_bytes_per_token_and_contexts_are_the_spec_figures():
    rows = memory_json("--models", ",".join(PAPER_ROWS), "--context", "32000,32768")
    assert rows["melt-1.6b"]["kv_bytes_per_token"] == 196_608  # 2 x 24 x 16 x 128 x 2
    assert rows["ouro-1.4b-thinking"]["kv_bytes_per_token"] == 786_432  # x4: one entry per loop
    assert rows["qwen3-1.7b"]["kv_bytes_per_token"] == 114_688  # 28 layers, 8 KV heads x 128
    for name, row in rows.items():
        assert set(row) >= {"model", "kv_bytes_per_token", "params", "model_bytes", "contexts"}
        assert row["model_bytes"] == 2 * row["params"]  # bf16
        assert [c["tokens"] for c in row["contexts"]] == [32_000, 32_768]
        for c in row["contexts"]:
            assert c["kv_bytes"] == c["tokens"] * row["kv_bytes_per_token"]
            assert c["total_bytes"] == row["model_bytes"] + c["kv_bytes"]
    # MELT = Ouro-1.4B + 24 x (2 x 2048^2 + 2048) gate parameters; model GB as the paper prints them
    assert rows["melt-1.6b"]["params"] - rows["ouro-1.4b-thinking"]["params"] == 201_375_744
    assert round(rows["melt-1.6b"]["model_bytes"] / 1e9, 3) == 3.272
    assert round(rows["ouro-1.4b-thinking"]["model_bytes"] / 1e9, 3) == 2.869


def test_the_papers_32k_column_is_32000_tokens_and_its_totals_are_not_model_plus_kv():
    rows = {r.model: r for r in memory_table(PAPER_ROWS, contexts=(32_000, 32_768))}
    kv_32000 = {m: round(r.context(32_000).kv_bytes / 1e9, 2) for m, r in rows.items()}
    kv_32768 = {m: round(r.context(32_768).kv_bytes / 1e9, 2) for m, r in rows.items()}
    assert kv_32000 == {"melt-1.6b": 6.29, "ouro-1.4b-thinking": 25.17, "qwen3-1.7b": 3.67}
    assert kv_32000 == {m: r.paper.kv_gb_32k for m, r in rows.items()}  # the paper's column
    assert kv_32768 == {"melt-1.6b": 6.44, "ouro-1.4b-thinking": 25.77, "qwen3-1.7b": 3.76}  # its text's 32k
    assert {m: r.paper.kv_32k_tokens for m, r in rows.items()} == dict.fromkeys(rows, 32_000)
    assert {m: r.paper.total_gb_32k for m, r in rows.items()} == {"melt-1.6b": 9.49, "ouro-1.4b-thinking": 27.97,
                                                                 "qwen3-1.7b": 7.07}
    assert {m: round(r.paper.model_plus_kv_gb, 2) for m, r in rows.items()} == {
        "melt-1.6b": 9.56, "ouro-1.4b-thinking": 28.04, "qwen3-1.7b": 7.11}
    assert not any(r.paper.total_is_model_plus_kv for r in rows.values())
    notes = " ".join(paper_notes(list(rows.values())))
    assert "32,000 tokens" in notes and "not model + KV" in notes and "9.49 vs 3.272 + 6.29 = 9.56" in notes


def test_models_without_a_plain_attention_config_carry_the_papers_vllm_reading_marked():
    rows = memory_json("--models", "gemma4-e2b,qwen3.5-2b,deepseek-r1-1.5b", "--context", "32000")
    assert rows["gemma4-e2b"]["kv_bytes_per_token"] == 35_840
    assert rows["qwen3.5-2b"]["kv_bytes_per_token"] == 49_152
    assert rows["gemma4-e2b"]["kv_source"] == rows["qwen3.5-2b"]["kv_source"] == "paper (vLLM reading)"
    assert rows["deepseek-r1-1.5b"]["kv_source"] == "analytic"
    assert rows["deepseek-r1-1.5b"]["kv_bytes_per_token"] == 28_672  # 28 layers x 2 KV heads x 128
    res = runner.invoke(app, ["memory", "--models", "gemma4-e2b,qwen3-1.7b"], env={"COLUMNS": "250"})
    assert res.exit_code == 0, res.output
    assert "35,840*" in res.output and "114,688*" not in res.output
    assert "vLLM reading" in res.output


def test_table_shows_both_contexts_and_the_papers_columns():
    res = runner.invoke(app, ["memory"], env={"COLUMNS": "250"})
    assert res.exit_code == 0, res.output
    for shown in ["196,608", "786,432", "114,688", "@32,000", "@32,768", "9.49", "27.97", "7.07", "9.56", "28.04", "7.11"]:
        assert shown in res.output, shown
    assert "not model + KV" in res.output


def test_latex_compiles_and_carries_both_sets_of_figures(tmp_path):
    rows = memory_table(PAPER_ROWS, contexts=(32_000, 32_768))
    tex = render_latex(as_table(rows, (32_000, 32_768)))
    assert "\\toprule" in tex and "\\bottomrule" in tex
    assert "196{,}608" in tex and "6.291" in tex and "6.442" in tex and "9.49" in tex
    res = runner.invoke(app, ["memory", "--models", ",".join(PAPER_ROWS), "--format", "latex"])
    assert res.exit_code == 0 and res.output.strip() == tex.strip()
    if shutil.which("pdflatex") is None:
        pytest.skip("pdflatex not installed: structure checked only")
    (tmp_path / "m.tex").write_text(standalone(tex))
    run = subprocess.run(["pdflatex", "-interaction=nonstopmode", "-halt-on-error", "m.tex"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-2000:]


def test_loops_override_grows_ouro_and_leaves_melt_flat():
    from melt_eval.report.memory import kv_bytes_per_token_at

    assert [kv_bytes_per_token_at("ouro-1.4b-thinking", None, t) for t in (1, 2, 4, 8)] == [196_608 * t for t in (1, 2, 4, 8)]
    assert {kv_bytes_per_token_at("melt-1.6b", None, t) for t in (1, 2, 4, 8)} == {196_608}
    assert kv_bytes_per_token_at("ouro-1.4b-thinking", None, 4, kv_sharing="last") == 196_608


def test_measure_vllm_reports_what_the_backend_measured(monkeypatch):
    fake = types.ModuleType("melt_eval.generation.vllm_backend")
    fake.measure_kv = lambda models: [{"model": m, "kv_bytes_per_token": 1000 + i, "capacity_tokens": 7}
                                      for i, m in enumerate(models)]
    monkeypatch.setitem(sys.modules, "melt_eval.generation.vllm_backend", fake)
    rows = memory_json("--models", "melt-1.6b,qwen3-1.7b", "--measure", "vllm")
    assert rows["melt-1.6b"]["measured"]["kv_bytes_per_token"] == 1000
    assert rows["qwen3-1.7b"]["measured"]["kv_bytes_per_token"] == 1001
    assert rows["melt-1.6b"]["kv_bytes_per_token"] == 196_608  # the analytic figure stays beside
    res = runner.invoke(app, ["memory", "--models", "melt-1.6b", "--measure", "vllm"], env={"COLUMNS": "250"})
    assert res.exit_code == 0 and "vLLM KV" in res.output and "1,000" in res.output
    assert "differ from ours for MELT-1.6B (1,000 vs 196,608)" in res.output


def run_main(args, capsys) -> tuple[int, str]:
    """The console entry point as a user runs it: exit code and stderr."""
    from melt_eval.cli import main

    old, sys.argv = sys.argv, ["melt-eval", *args]
    try:
        main()
        code = 0
    except SystemExit as exc:
        code = exc.code
    finally:
        sys.argv = old
    return code, capsys.readouterr().err


def test_measure_vllm_unavailable_is_one_clear_error(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "melt_eval.generation.vllm_backend", None)  # import fails
    code, err = run_main(["memory", "--measure", "vllm"], capsys)
    assert code == 2
    assert err.count("\n") == 1 and "--measure vllm is unavailable" in err and "--measure analytic" in err


@pytest.mark.parametrize("args, message", [
    (["memory", "--models", "nosuch"], "--models takes the registry's names, not 'nosuch'"),
    (["memory", "--models", "./runs/melt"], "--models takes the registry's names"),  # no "pass a checkpoint" hint
    (["memory", "--models", ""], "--models names no model"),
    (["memory", "--models", " , "], "--models names no model"),
    (["memory", "--context", "abc"], "--context takes integers"),
    (["memory", "--context", "0"], "token counts from 1 to 2,147,483,647"),
    (["memory", "--context", str(10**23)], "token counts from 1 to 2,147,483,647"),
    # --format xml, --measure guess: click's error naming the choices, exit 2 (tests/test_cli_flags.py)
])
def test_bad_input_is_one_line_and_exit_2(args, message, capsys):
    code, err = run_main(args, capsys)
    assert code == 2
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err
