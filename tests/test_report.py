"""`melt-eval report` and `melt-eval memory`: the paper's tables cell for cell, gaps as n/a, figures."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from melt_eval.cli import app
from melt_eval.report.cli import write_report
from melt_eval.report.results import load_results
from melt_eval.report.tables import build_tables, render_latex

PAPER_TEX = Path(__file__).resolve().parents[2] / "shared" / "spec" / "paper.tex"
runner = CliRunner()
NUMBER = re.compile(r"^\s*(?:\{\\footnotesize\s*)?(?:\\hspace\{[^}]*\}\s*)?(\\textbf\{|\\underline\{)?\s*(?:\$\\times\$)?(-?\d+\.\d+)")


def table_cells(tex: str) -> list[list[tuple[float, bool, bool]]]:
    """Rows of (value, bold, underlined) for every numeric cell of a tabular's body."""
    lines = [line.split("%")[0] if not line.lstrip().startswith("%") else "" for line in tex.splitlines()]
    body = "\n".join(lines)
    body = body[body.index("\\midrule") + len("\\midrule") :]
    body = body[: body.index("\\end{tabular}")]
    rows = []
    for row in re.split(r"\\\\(?:\[[^\]]*\])?", body):
        cells = []
        for cell in row.split("&")[1:]:
            m = NUMBER.match(cell.replace("\\rowcolor{gray!15}", ""))
            if m:
                cells.append((float(m.group(2)), m.group(1) == "\\textbf{", m.group(1) == "\\underline{"))
        if cells:
            rows.append(cells)
    return rows


# the label of each table in paper.tex (it precedes the tabular), and the key of ours
PAPER_TABLES = {
    "main": "tab:perf_comparison_transposed",
    "gates": "tab:gate_ablation",
    "components": "tab:component_ablation",
    "kv-sharing": "tab:untrained_kv_sharing_ablation",
    "memory": "tab:memory_usage",
}


def paper_tabular(label: str) -> str:
    if not PAPER_TEX.exists():
        pytest.skip("../shared/spec/paper.tex is not present")
    text = PAPER_TEX.read_text()
    begin = text.index("\\begin{tabular}", text.index(f"\\label{{{label}}}"))
    return text[begin : text.index("\\end{tabular}", begin) + len("\\end{tabular}")]


@pytest.fixture(scope="module")
def paper_only_tables(tmp_path_factory):
    return {t.key: t for t in build_tables(load_results(tmp_path_factory.mktemp("empty")))}


@pytest.mark.parametrize("key", list(PAPER_TABLES))
def test_paper_numbers_reproduce_the_papers_tables_cell_for_cell(key, paper_only_tables):
    paper = table_cells(paper_tabular(PAPER_TABLES[key]))
    ours = table_cells(render_latex(paper_only_tables[key]))
    assert len(paper) >= 3, "too few numeric rows parsed from the paper"
    if key == "memory":  # ours also keeps the three rows the paper comments out of its table
        assert len(ours) == len(paper) + 3
        ours = ours[: len(paper)]
    assert ours == paper


def _result(root: Path, rel: str, metrics: dict, **extra) -> None:
    path = root / rel / "results.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"finished": True, "metrics": {k: {"value": v, "stderr": 0.01} for k, v in metrics.items()},
            "settings": extra.pop("settings", {}), **extra}
    path.write_text(json.dumps(body))


def test_gaps_read_n_a_and_compare_prints_the_paper_beside(tmp_path):
    _result(tmp_path, "melt-1.6b/aime24", {"pass@1": 0.5, "pass@10": 0.8}, model="melt-1.6b")
    _result(tmp_path, "ablations/gates/scalar/aime24", {"pass@1": 0.3, "pass@10": 0.6})
    unfinished = tmp_path / "qwen3-1.7b" / "aime24" / "results.json"
    unfinished.parent.mkdir(parents=True)
    unfinished.write_text(json.dumps({"finished": False, "metrics": {"pass@1": {"value": 0.9}}}))
    out = write_report(tmp_path, tmp_path / "report", paper=True, plots=False)
    md = (tmp_path / "report" / "report.md").read_text()
    main = md.split("### Gate ablation")[0]
    assert "| AIME24 | pass@1 |" in main
    aime_row = next(line for line in main.splitlines() if line.startswith("| AIME24 | pass@1 |"))
    cells = [c.strip() for c in aime_row.strip("|").split("|")][2:]
    assert cells[1].startswith("**50.0** ± 1.0 (paper 46.7, Δ +3.3)")  # MELT-1.6B: ours, then the paper's
    assert cells[2] == "n/a (paper 43.1)"  # Qwen3: only an unfinished run, so n/a, never 0
    assert "0.0" not in cells[2]
    gates = md.split("### Gate ablation")[1].split("###")[0]
    assert "| Single-gated | **30.0** (paper 34.4, Δ −4.4)" in gates  # the only value: best
    assert any("unfinished" in n for n in out["notes"])


def test_every_table_and_the_latex_compiles(tmp_path):
    import shutil
    import subprocess

    _result(tmp_path, "melt-1.6b/math500", {"accuracy": 0.9}, model="melt-1.6b")
    write_report(tmp_path, tmp_path / "r", plots=False)
    tex = (tmp_path / "r" / "report.tex").read_text()
    for label in ("tab:main", "tab:gates", "tab:components", "tab:kv-sharing", "tab:memory"):
        assert f"\\label{{{label}}}" in tex
    assert "\\toprule" in tex and "\\bottomrule" in tex and "\\documentclass" in tex
    if shutil.which("pdflatex") is None:
        pytest.skip("pdflatex not installed: structure checked only")
    run = subprocess.run(["pdflatex", "-interaction=nonstopmode", "-halt-on-error", "report.tex"], cwd=tmp_path / "r",
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-2000:]
    assert (tmp_path / "r" / "report.pdf").stat().st_size > 0


def test_plots_are_written_with_reproduced_and_loop_points(tmp_path):
    _result(tmp_path, "melt-1.6b/math500", {"accuracy": 0.9}, model="melt-1.6b")
    for loops, cache in [(2, 100), (4, 100)]:
        _result(tmp_path, f"loops/melt-t{loops}/synthetic", {"pass@1": 0.5}, model="melt-tiny",
                settings={"loops": loops}, peak_cache_bytes=cache * 10**6)
        _result(tmp_path, f"loops/ouro-t{loops}/synthetic", {"pass@1": 0.6}, model="ouro-tiny",
                settings={"loops": loops}, peak_cache_bytes=cache * loops * 10**6)
    out = write_report(tmp_path, tmp_path / "r", latex=False)
    names = {p.name for p in out["files"]}
    assert {"memory_vs_accuracy.png", "memory_vs_accuracy.pdf", "loops.png", "loops.pdf"} <= names
    for p in out["files"]:
        assert p.stat().st_size > 1000


def test_report_cli_without_results_renders_the_paper(tmp_path):
    res = runner.invoke(app, ["report", "--results", str(tmp_path / "none"), "--output", str(tmp_path / "out"), "--no-plots"])
    assert res.exit_code == 0, res.output
    assert "paper's own tables" in res.output
    assert (tmp_path / "out" / "report.md").exists() and (tmp_path / "out" / "report.tex").exists()


def test_memory_json_has_the_spec_figures():
    res = runner.invoke(app, ["memory", "--models", "melt-1.6b,ouro-1.4b-thinking,qwen3-1.7b", "--context", "32768",
                              "--format", "json"])
    assert res.exit_code == 0, res.output
    rows = {r["model"]: r for r in json.loads(res.output)}
    assert rows["melt-1.6b"]["kv_bytes_per_token"] == 196_608
    assert rows["ouro-1.4b-thinking"]["kv_bytes_per_token"] == 4 * 196_608
    assert rows["qwen3-1.7b"]["kv_bytes_per_token"] == 114_688
    ctx = rows["melt-1.6b"]["contexts"][0]
    assert ctx["tokens"] == 32768 and ctx["kv_bytes"] == 196_608 * 32768
    assert ctx["total_bytes"] == rows["melt-1.6b"]["model_bytes"] + ctx["kv_bytes"]
    assert rows["melt-1.6b"]["params"] == rows["ouro-1.4b-thinking"]["params"] + 201_375_744  # + the gates


@pytest.mark.parametrize("args, message", [
    (["memory", "--models", "nosuch"], "unknown model"),
    (["memory", "--context", "abc"], "--context takes integers"),
    (["memory", "--format", "xml"], "--format must be"),
])
def test_memory_bad_input(args, message):
    res = runner.invoke(app, args)
    assert res.exit_code != 0
    assert message in str(res.exception) or message in res.output
