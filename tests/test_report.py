"""`melt-eval report` and `melt-eval memory`: the paper's tables cell for cell, gaps as n/a, figures."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from melt_eval.cli import app
from melt_eval.registry import MODELS
from melt_eval.report.render import render_latex
from melt_eval.report.results import load_results
from melt_eval.report.tables import build_tables
from melt_eval.report.write import write_report

PAPER_TEX = Path(__file__).resolve().parents[2] / "shared" / "spec" / "paper.tex"
runner = CliRunner()
NUMBER = re.compile(r"^\s*(?:\{\\footnotesize\s*)?(?:\\hspace\{[^}]*\}\s*)?(\\textbf\{|\\underline\{)?\s*(?:\$\\times\$)?(-?\d+\.\d+)")
STDERR = re.compile(r"\$\\pm\$\s*(\d+\.\d+)")


def table_cells(tex: str, stderr: bool = False) -> list[list[tuple]]:
    """Rows of (value, bold, underlined[, stderr]) for every numeric cell of a tabular's body."""
    lines = [line.split("%")[0] if not line.lstrip().startswith("%") else "" for line in tex.splitlines()]
    body = "\n".join(lines)
    body = body[body.index("\\midrule") + len("\\midrule") :]
    body = body[: body.index("\\end{tabular}")]
    rows = []
    for row in re.split(r"\\\\(?:\[[^\]]*\])?", body):
        cells = []
        for text in row.split("&")[1:]:
            m = NUMBER.match(text.replace("\\rowcolor{gray!15}", ""))
            if m:
                cell = (float(m.group(2)), m.group(1) == "\\textbf{", m.group(1) == "\\underline{")
                if stderr:
                    e = STDERR.search(text)
                    cell += (float(e.group(1)) if e else None,)
                cells.append(cell)
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
    paper = table_cells(paper_tabular(PAPER_TABLES[key]), stderr=True)
    ours = table_cells(render_latex(paper_only_tables[key]), stderr=True)
    assert len(paper) >= 3, "too few numeric rows parsed from the paper"
    if key == "memory":  # ours also keeps the three rows the paper comments out of its table
        assert len(ours) == len(paper) + 3
        ours = ours[: len(paper)]
    assert ours == paper


def write_paper_as_results(root: Path) -> None:
    """Test fixture: the paper's numbers written as results.json files (fractions, as `run` writes them)."""
    from melt_eval.protocol.labels import MAIN_MODELS
    from melt_eval.report.paper import ABLATIONS, benchmark_metrics, paper_results

    pr = paper_results()
    main = pr["main_comparison"]
    for model, key in MAIN_MODELS.items():
        for bench, scores in main["scores"][key].items():
            errs = main["stderr"][key][bench]
            metrics = {m: {"value": v / 100, "stderr": e / 100} for (m, v), e in zip(scores.items(), errs)}
            assert list(scores) == benchmark_metrics(bench)
            _write(root / model / bench / "results.json", {"model": model, "metrics": metrics})
    for ablation, info in ABLATIONS.items():
        for variant, (key, _) in info["variants"].items():
            for bench, scores in pr[info["section"]][key].items():
                metrics = {m: {"value": v / 100, "stderr": None} for m, v in scores.items()}
                _write(root / "ablations" / ablation / variant / bench / "results.json", {"model": variant, "metrics": metrics})


def _write(path: Path, body: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"finished": True, "settings": {}, **body}))


@pytest.mark.parametrize("key", ["main", "gates", "components", "kv-sharing"])
def test_fed_the_papers_numbers_as_results_the_report_reproduces_its_tables(key, tmp_path):
    write_paper_as_results(tmp_path)
    table = {t.key: t for t in build_tables(load_results(tmp_path))}[key]
    assert table.source == "results"
    ours = table_cells(render_latex(table), stderr=True)
    paper = table_cells(paper_tabular(PAPER_TABLES[key]), stderr=True)
    if key == "main":
        # Ours computes the averages from the cells; the paper prints 45.5 for Gemma4-E2B's non-math
        # average where its own cells (39.1, 2.0, 75.3, 61.6) average to 44.5. Everything else is identical.
        assert paper[-1][3] == (45.5, False, False, None)
        paper[-1][3] = (44.5, False, False, None)
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
    corrupt = tmp_path / "gemma4-e2b" / "aime24" / "results.json"
    corrupt.parent.mkdir(parents=True)
    corrupt.write_text("{not json")
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
    assert any("unfinished" in n for n in out["notes"]) and any("unreadable" in n for n in out["notes"])
    tex = (tmp_path / "report" / "report.tex").read_text()
    aime = next(line for line in tex.splitlines() if line.startswith("AIME24 & pass@1"))
    assert aime.count("n/a") == 5 and "\\textbf{50.0}" in aime


@pytest.mark.parametrize("mode", ["results", "results-with-paper", "paper-only"])
def test_every_table_and_the_latex_compiles(mode, tmp_path):
    import shutil
    import subprocess

    if mode != "paper-only":
        _result(tmp_path, "melt-1.6b/math500", {"accuracy": 0.9}, model="melt-1.6b")
        _result(tmp_path, "ablations/gates/mean/aime24", {"pass@1": 0.3, "pass@10": 0.6})
    write_report(tmp_path, tmp_path / "r", plots=False, paper=mode == "results-with-paper")
    tex = (tmp_path / "r" / "report.tex").read_text()
    labels = ["tab:main", "tab:gates", "tab:components", "tab:kv-sharing", "tab:memory"]
    labels += [] if mode == "paper-only" else ["tab:claims"]  # the claims are checked against results only
    for label in labels:
        assert f"\\label{{{label}}}" in tex
    assert tex.count("\\toprule") == tex.count("\\bottomrule") == tex.count("\\begin{tabular}") == len(labels)
    assert "\\documentclass" in tex and "\\usepackage{booktabs}" in tex and tex.rstrip().endswith("\\end{document}")
    if shutil.which("pdflatex") is None:
        pytest.skip("pdflatex not installed: structure checked only")
    run = subprocess.run(["pdflatex", "-interaction=nonstopmode", "-halt-on-error", "report.tex"], cwd=tmp_path / "r",
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-2000:]
    assert (tmp_path / "r" / "report.pdf").stat().st_size > 0


def test_plots_are_written_with_reproduced_and_loop_points(tmp_path):
    from melt_eval.report.plots import loops_points, memory_accuracy_points

    _result(tmp_path, "melt-1.6b/math500", {"accuracy": 0.9}, model="melt-1.6b", settings={"loops": 4},
            model_path="/ck/melt")
    _result(tmp_path, "qwen3-1.7b/math500", {"accuracy": 0.88}, model="qwen3-1.7b")
    # `run --loops T --name melt-1.6b-T<T>`: same checkpoint, other names; they join the T = 4 run
    for loops in (1, 2):
        _result(tmp_path, f"melt-1.6b-T{loops}/math500", {"accuracy": 0.8 + loops / 100}, model=f"melt-1.6b-T{loops}",
                settings={"loops": loops}, model_path="/ck/melt", peak_cache_bytes=10**6)
    # the demo's layout: results/loops/<name>-T<T>/ with the model's own name
    for loops in (1, 2, 4):
        _result(tmp_path, f"loops/ouro-1.4b-thinking-T{loops}/math500", {"accuracy": 0.85 + loops / 100},
                model="ouro-1.4b-thinking", settings={"loops": loops}, model_path="/ck/ouro", peak_cache_bytes=loops * 10**6)
    rs = load_results(tmp_path)

    lines = loops_points(rs)
    assert set(lines) == {"melt-1.6b", "ouro-1.4b-thinking"}
    melt, ouro = lines["melt-1.6b"], lines["ouro-1.4b-thinking"]
    assert [p.loops for p in melt] == [1, 2, 4] and [p.accuracy for p in melt] == pytest.approx([81, 82, 90])
    assert {p.kv_32k_gb for p in melt} == {196_608 * 32_768 / 1e9}  # flat in T
    assert [p.kv_32k_gb for p in ouro] == pytest.approx([196_608 * 32_768 * t / 1e9 for t in (1, 2, 4)])  # grows
    assert [p.measured_mb for p in ouro] == [1, 2, 4]

    points = {(p.label, p.source): p for p in memory_accuracy_points(rs)}
    melt_total = (2 * MODELS["melt-1.6b"].params + 196_608 * 32_768) / 1e9
    assert points[("MELT-1.6B", "reproduced")].x == pytest.approx(melt_total) and points[("MELT-1.6B", "reproduced")].melt
    assert points[("MELT-1.6B", "paper")].x == 9.49 and points[("MELT-1.6B", "paper")].y == 93.4
    assert points[("Qwen3-1.7B", "reproduced")].y == pytest.approx(88.0)
    assert ("DeepSeek-R1-1.5B", "paper") in points and ("DeepSeek-R1-1.5B", "reproduced") not in points

    # the loop sweeps stay out of the model tables
    main = {t.key: t for t in build_tables(rs)}["main"]
    assert "melt-1.6b-T1" not in main.heads and "MELT-1.6B" in main.heads
    assert any("other loop counts" in n for n in main.notes)

    out = write_report(tmp_path, tmp_path / "r", latex=False)
    names = {p.name for p in out["files"]}
    assert {"memory_vs_accuracy.png", "memory_vs_accuracy.pdf", "loops.png", "loops.pdf"} <= names
    for p in out["files"]:
        assert p.stat().st_size > 1000


def test_report_cli_writes_figures_to_plots_by_default(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _result(tmp_path / "results", "melt-1.6b/math500", {"accuracy": 0.9}, model="melt-1.6b")
    res = runner.invoke(app, ["report", "--markdown"])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "results" / "report" / "report.md").exists()
    assert not (tmp_path / "results" / "report" / "report.tex").exists()  # only what was asked for
    for name in ("memory_vs_accuracy.png", "memory_vs_accuracy.pdf", "loops.png", "loops.pdf"):
        assert (tmp_path / "plots" / name).stat().st_size > 1000


def assert_one_line_error(capsys, args: list[str]) -> str:
    """`melt-eval ARGS` as a user runs it: exit code 2 and one line on stderr saying what to do; that line."""
    from helpers import main_exit_code

    code = main_exit_code(args)
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    return err


def test_report_cli_bad_paths_are_one_line_errors(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    for args in (["--results", str(tmp_path / "typo")], ["--results", str(tmp_path), "--output", str(tmp_path / "file")]):
        assert_one_line_error(capsys, ["report", *args])
    assert not (tmp_path / "report").exists()


def test_report_on_a_demo_directory_reads_its_results_and_an_unwritable_output_says_so(tmp_path, capsys):
    """`report --results DEMO` reads DEMO/results (a demo's directory holds no results.json of its own); an --output
    that cannot be made is refused with advice that fits (not "free space")."""
    _demo_like_results(tmp_path / "demo" / "results")
    (tmp_path / "demo" / "demo.json").write_text(json.dumps({"seed": 0, "quick": False}))
    res = runner.invoke(app, ["report", "--results", str(tmp_path / "demo"), "--output", str(tmp_path / "out"), "--no-plots"])
    assert res.exit_code == 0, res.output
    assert "paper's own tables" not in res.output and "melt-tiny" in (tmp_path / "out" / "report.md").read_text()
    # /proc takes no new folders, even from root
    err = assert_one_line_error(capsys, ["report", "--results", str(tmp_path / "demo"), "--output", "/proc/melt-eval/r", "--no-plots"])
    assert "cannot write" in err and "pass a path you can write" in err and "free space" not in err


def test_report_cli_without_results_renders_the_paper(tmp_path):
    (tmp_path / "none").mkdir()
    res = runner.invoke(app, ["report", "--results", str(tmp_path / "none"), "--output", str(tmp_path / "out"), "--no-plots"])
    assert res.exit_code == 0, res.output
    assert "paper's own tables" in res.output
    assert (tmp_path / "out" / "report.md").exists() and (tmp_path / "out" / "report.tex").exists()


def _demo_like_results(root: Path, **override) -> None:
    """A demo's results layout: main models melt-tiny and ouro-tiny, every ablation row, a loop sweep."""
    scores = {"melt-tiny": 0.50, "ouro-tiny": 0.52,
              "kv-sharing/ouro": 0.52, "kv-sharing/last-prefill": 0.10, "kv-sharing/last": 0.0,
              "kv-sharing/first-prefill": 0.05, "kv-sharing/first": 0.0,
              "components/full": 0.50, "components/no-align": 0.45, "components/no-interp": 0.30,
              "components/no-kd": 0.20, "components/no-chunk": 0.0,
              "gates/elementwise": 0.45, "gates/scalar": 0.40, "gates/ema-0.2": 0.30, "gates/mean": 0.35, "gates/last": 0.3,
              "melt-T1": 0.1, "melt-T2": 0.2, "melt-T3": 0.3, "ouro-T1": 0.2, "ouro-T2": 0.3, "ouro-T3": 0.4}
    scores.update(override)
    path = {"melt-tiny": "/ck/melt", "ouro-tiny": "/ck/ouro", "kv-sharing/ouro": "/ck/ouro", "components/full": "/ck/melt"}
    for name, value in scores.items():
        melt_cache = name.startswith("melt") or "/" in name and not name.startswith("kv-sharing")
        extra = dict(model_path=path.get(name, f"/ck/{name}"), peak_cache_bytes=1000 if melt_cache else 4000,
                     settings={"loops": 4})
        if name.startswith(("melt-T", "ouro-T")):
            model = name[:4] + "-tiny"
            rel, extra["model"] = f"loops/{model}-{name[5:]}/synthetic", model
            extra.update(model_path=f"/ck/{name[:4]}", settings={"loops": int(name[-1])})
        elif "/" in name:
            rel = f"ablations/{name}/synthetic"
        else:
            rel, extra["model"] = f"{name}/synthetic", name
        _result(root, rel, {"pass@1": value, "pass@10": min(1.0, 2 * value)}, **extra)


def test_claims_are_computed_from_the_results(tmp_path):
    from melt_eval.report.claims import paper_claims

    _demo_like_results(tmp_path / "good")
    claims = paper_claims(load_results(tmp_path / "good"))
    assert len(claims) == 7 and all(c.holds for c in claims), [(c.claim, c.measured) for c in claims]
    keeps = claims[0]
    assert keeps.values["ratio"] == pytest.approx(0.50 / 0.52) and keeps.values["cache_ratio"] == 0.25
    assert "melt-tiny 50.0 / ouro-tiny 52.0" in keeps.measured
    assert all(set(c.to_json()) >= {"claim", "measured", "threshold", "holds"} for c in claims)
    # the paper's own numbers, through the same checks (its T figure has no numbers to check)
    # (nor has it Ouro at T = 1)
    assert [c.paper_holds for c in claims] == [True, True, True, True, True, None, None]

    # each claim can fail: numbers that contradict the paper are reported as such
    _demo_like_results(tmp_path / "bad", **{"melt-tiny": 0.40, "kv-sharing/last-prefill": 0.2, "components/no-chunk": 0.2,
                                            "components/no-kd": 0.35, "gates/mean": 0.46, "melt-T3": 0.05,
                                            "ouro-T1": 0.27})
    bad = paper_claims(load_results(tmp_path / "bad"))
    assert [c.holds for c in bad] == [False] * 7, [(c.claim, c.measured) for c in bad]
    assert "last-prefill 0.38" in bad[1].measured and "mean 46.0" in bad[4].measured

    # a claim whose results are missing is n/a, never a pass
    _result(tmp_path / "partial", "melt-tiny/synthetic", {"pass@1": 0.5}, model="melt-tiny")
    assert [c.holds for c in paper_claims(load_results(tmp_path / "partial"))] == [None] * 7


def test_a_claim_resting_on_less_than_two_standard_errors_says_so_without_changing_its_verdict(tmp_path):
    from melt_eval.report.claims import paper_claims

    # every result has stderr 0.01: a 1-point lead is 0.7 standard errors of the difference
    _demo_like_results(tmp_path / "close", **{"gates/scalar": 0.44, "components/no-kd": 0.295})
    claims = paper_claims(load_results(tmp_path / "close"))
    ladder, gates = claims[3], claims[4]
    assert ladder.holds and gates.holds  # the verdicts follow the thresholds alone
    assert gates.values["lead_in_stderr"] == pytest.approx(0.01 / (2 * 0.01 ** 2) ** 0.5)
    assert gates.measured.endswith("; within 2 standard errors: elementwise - scalar +1.0 (0.7 se)")
    assert ladder.values["drops_in_stderr"]["-kd"] == pytest.approx(0.005 / (2 * 0.01 ** 2) ** 0.5)
    assert ladder.measured.endswith("; within 2 standard errors: -kd -0.5 (0.4 se)")
    # wide gaps are not named; a result without a standard error names nothing and claims nothing
    _demo_like_results(tmp_path / "good")
    good = paper_claims(load_results(tmp_path / "good"))
    assert "standard errors" not in good[3].measured + good[4].measured
    scalar = tmp_path / "close" / "ablations" / "gates" / "scalar" / "synthetic" / "results.json"
    body = json.loads(scalar.read_text())
    del body["metrics"]["pass@1"]["stderr"]
    scalar.write_text(json.dumps(body))
    gates = paper_claims(load_results(tmp_path / "close"))[4]
    assert gates.holds and gates.values["lead_in_stderr"] is None and "standard errors" not in gates.measured


def _details(root: Path, variant: str, scores: list[float], golds: list[str] | None = None) -> None:
    """An evaluation's details.jsonl: one row per problem with the pass@1 LightEval gave it."""
    golds = golds or [str(i % 10) for i in range(len(scores))]
    rows = [{"index": i, "gold": g, "completions": [], "metrics": {"pass@1": s, "pass@10": float(s > 0)}}
            for i, (s, g) in enumerate(zip(scores, golds))]
    path = root / ("" if variant.startswith("loops/") else "ablations") / variant / "synthetic" / "details.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_a_gap_between_two_models_is_measured_against_its_paired_error_where_both_kept_their_problems(tmp_path):
    from melt_eval.report.claims import paper_claims

    # 20 problems. The element-wise gate solves 8 and half of 2 more (0.45); the scalar gate the same 8 and 0 of
    # the 2 (0.40). The results' own errors (0.01 each, as _result writes them) combined as if independent make
    # the 5-point lead 3.5 standard errors; the per-problem differences (0.5 on 2 problems of 20) make it 1.5.
    elementwise = [1.0] * 8 + [0.5] * 2 + [0.0] * 10
    scalar = [1.0] * 8 + [0.0] * 12
    _demo_like_results(tmp_path, **{"gates/elementwise": 0.45, "gates/scalar": 0.40})
    _details(tmp_path, "gates/elementwise", elementwise)
    _details(tmp_path, "gates/scalar", scalar)
    diffs = [a - b for a, b in zip(elementwise, scalar)]
    paired = (sum((d - 0.05) ** 2 for d in diffs) / 19 / 20) ** 0.5
    gates = paper_claims(load_results(tmp_path))[4]
    assert gates.values["lead_stderr_method"] == "paired"
    assert gates.values["lead_in_stderr"] == pytest.approx(0.05 / paired) == pytest.approx(1.45, abs=0.01)
    assert gates.holds and gates.measured.endswith("; within 2 standard errors: elementwise - scalar +5.0 (1.5 se)")
    assert gates.close_call  # a ✓ on a 1.5-se lead: a rerun could turn it

    # details of other problems, or of another evaluation (their scores do not average to its result), are not
    # paired: the results' own errors are combined as if independent (0.01 each here)
    _details(tmp_path, "gates/scalar", scalar, golds=["x"] * 20)
    gates = paper_claims(load_results(tmp_path))[4]
    assert gates.values["lead_stderr_method"] == "independent"
    assert gates.values["lead_in_stderr"] == pytest.approx(0.05 / (2 * 0.01 ** 2) ** 0.5)
    assert gates.close_call is False  # 3.5 standard errors
    _details(tmp_path, "gates/scalar", [1.0] * 10 + [0.0] * 10)  # averages 0.50, the result says 0.40
    assert paper_claims(load_results(tmp_path))[4].values["lead_stderr_method"] == "independent"
    # the ladder's steps are paired the same way, each step on its own
    _details(tmp_path, "gates/scalar", scalar)
    _details(tmp_path, "components/no-interp", [1.0] * 6 + [0.0] * 14)  # 0.30, the no-interp row
    _details(tmp_path, "components/no-kd", [1.0] * 4 + [0.0] * 16)  # 0.20
    ladder = paper_claims(load_results(tmp_path))[3]
    assert ladder.values["drops_stderr_method"] == {"-align": "independent", "-interp": "independent", "-kd": "paired"}
    kd_diffs = [1.0] * 2 + [0.0] * 18  # no-interp minus no-kd
    kd_se = (sum((d - 0.1) ** 2 for d in kd_diffs) / 19 / 20) ** 0.5
    assert ladder.values["drops_in_stderr"]["-kd"] == pytest.approx(0.1 / kd_se)
    # a ✓ whose last step is 1.5 standard errors: a close call, and the brief names that step as the removal reads
    assert ladder.holds and ladder.close_call and ladder.brief == "50.0 > 45.0 > 30.0 > 20.0 (-kd -1.5 se)"


def test_each_step_of_t_is_measured_in_standard_errors_so_a_swap_near_the_floor_reads_as_noise(tmp_path):
    from melt_eval.report.claims import paper_claims

    # MELT run with fewer loops than it was trained with scores near the floor: 10% at T = 1, 20% at T = 2 (20
    # problems each, two more solved at T = 2); paired, that step is 1.5 standard errors, so another machine's
    # floats could turn it. T = 3 kept no per-problem scores: its steps combine the results' own errors (0.01).
    _demo_like_results(tmp_path)
    _details(tmp_path, "loops/melt-tiny-T1", [1.0] * 2 + [0.0] * 18)
    _details(tmp_path, "loops/melt-tiny-T2", [1.0] * 4 + [0.0] * 16)
    loops = paper_claims(load_results(tmp_path))[5]
    assert loops.holds
    assert loops.values["rises_stderr_method"] == {"T 1->2": "paired", "T 2->3": "independent", "T 3->4": "independent"}
    diffs = [1.0] * 2 + [0.0] * 18
    paired = (sum((d - 0.1) ** 2 for d in diffs) / 19 / 20) ** 0.5
    assert loops.values["rises_in_stderr"]["T 1->2"] == pytest.approx(0.1 / paired) == pytest.approx(1.45, abs=0.01)
    assert loops.values["rises_in_stderr"]["T 2->3"] == pytest.approx(0.1 / (2 * 0.01 ** 2) ** 0.5)
    assert loops.measured.endswith("; within 2 standard errors: T 1->2 +10.0 (1.5 se)")
    assert loops.brief == "10.0 / 20.0 / 30.0 / 50.0; cache constant (T 1->2 +1.5 se)"
    assert loops.close_call and loops.to_json()["close_call"] is True  # a rerun could turn this ✓

    # the same two scores swapped: the claim fails, and the note says by how little
    _demo_like_results(tmp_path, **{"melt-T1": 0.2, "melt-T2": 0.1})
    _details(tmp_path, "loops/melt-tiny-T1", [1.0] * 4 + [0.0] * 16)
    _details(tmp_path, "loops/melt-tiny-T2", [1.0] * 2 + [0.0] * 18)
    loops = paper_claims(load_results(tmp_path))[5]
    assert not loops.holds and loops.measured.endswith("; within 2 standard errors: T 1->2 -10.0 (1.5 se)")
    assert loops.close_call  # ... and this ✗
    # a fall far beyond the noise (T = 1 without per-problem scores: 0.01 each, as if independent) is decided
    _demo_like_results(tmp_path, **{"melt-T1": 0.5})
    (tmp_path / "loops" / "melt-tiny-T1" / "synthetic" / "details.jsonl").unlink()
    loops = paper_claims(load_results(tmp_path))[5]
    assert not loops.holds and loops.close_call is False and "within" not in loops.measured


def test_claims_across_seeds_count_the_runs_each_claim_holds_in(tmp_path, capsys):
    # two demo output directories (results/ and demo.json); at seed 1 the scalar gate beats the element-wise one
    for seed, override in ((0, {}), (1, {"gates/scalar": 0.48})):
        _demo_like_results(tmp_path / f"demo-{seed}" / "results", **override)
        (tmp_path / f"demo-{seed}" / "demo.json").write_text(json.dumps({"seed": seed, "quick": False}))
    dirs = [str(tmp_path / "demo-0"), str(tmp_path / "demo-1")]

    res = runner.invoke(app, ["claims", *dirs, "--format", "json"])
    assert res.exit_code == 0, res.output
    got = json.loads(res.output)
    assert [(r["label"], r["claims_hold"]) for r in got["runs"]] == [("seed 0", 7), ("seed 1", 6)]
    gate = got["claims"][4]
    assert gate["claim"] == "The element-wise gate is the best gate"
    assert (gate["holds_in"], gate["measured_in"]) == (1, 2)
    assert [r["holds"] for r in gate["runs"]] == [True, False]
    assert gate["runs"][1]["brief"] == "45.0; scalar 48.0 (-2.1 se)"  # stderr 0.01 each: 0.03 / 0.0141
    assert [c["holds_in"] for c in got["claims"]] == [2, 2, 2, 2, 1, 2, 2]
    assert [c["close_calls"] for c in got["claims"]] == [0] * 7 and [r["close_calls"] for r in got["runs"]] == [0, 0]
    # each gate alone: the scalar gate is ahead at one seed of two, the others at none; the mean gap over the
    # seeds (+5 and -3 points against the scalar gate) with its standard error over them
    scalar, mean = got["gate_head_to_head"]["scalar"], got["gate_head_to_head"]["mean"]
    assert (scalar["elementwise_at_least_as_high"], scalar["runs"]) == (1, 2)
    assert scalar["mean_gap"] == pytest.approx(0.01) and scalar["gap_stderr"] == pytest.approx(0.04)
    assert (mean["elementwise_at_least_as_high"], mean["runs"], mean["mean_gap"]) == (2, 2, pytest.approx(0.10))

    res = runner.invoke(app, ["claims", *dirs, "--format", "markdown"])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert "| Claim | seed 0 | seed 1 | Holds in | The paper |" in lines
    gate_row = next(line for line in lines if line.startswith("| The element-wise gate"))
    assert "| ✓ 45.0; scalar 40.0 (+3.5 se) | ✗ 45.0; scalar 48.0 (-2.1 se) | 1 of 2 |" in gate_row
    ladder_row = next(line for line in lines if line.startswith("| Each other ladder"))
    assert "✓ 50.0 > 45.0 > 30.0 > 20.0" in ladder_row
    assert "| Claims that hold | 7 of 7 | 6 of 7 |" in res.output
    assert "| Close calls | 0 | 0 |" in res.output  # every gap here is over 2 standard errors
    assert ("(points, ± its standard error over the runs): scalar 1 of 2 (+1.0 ± 4.0), ema-0.2 2 of 2 (+15.0 ± 0.0), "
            "mean 2 of 2 (+10.0 ± 0.0), last 2 of 2 (+15.0 ± 0.0).") in res.output.replace("\n", " ")
    assert "\\begin{tabular}" in runner.invoke(app, ["claims", *dirs, "--format", "latex"]).output

    # a results root without demo.json is labelled by its directory; runs the seeds cannot tell apart too
    res = runner.invoke(app, ["claims", str(tmp_path / "demo-0" / "results"), dirs[1], "--format", "json"])
    assert [r["label"] for r in json.loads(res.output)["runs"]] == ["results", "demo-1"]

    # bad input: one line, exit 2, for a missing directory and for one without results (a bad --format: click's
    # error naming the choices, tests/test_cli_flags.py)
    (tmp_path / "empty").mkdir()
    for args in ([str(tmp_path / "typo")], [str(tmp_path / "empty")]):
        assert_one_line_error(capsys, ["claims", *args])


def test_claims_across_runs_read_a_saved_claims_json_as_its_results_gave_it(tmp_path, capsys):
    """A run whose results were not kept: its report/claims.json (as the demo writes it) gives the same table
    as its results did, and says the run was read so; a file of other claims is refused."""
    from melt_eval.files import write_json_atomic
    from melt_eval.report.claims import paper_claims

    for seed, override in ((0, {}), (1, {"gates/scalar": 0.48})):
        _demo_like_results(tmp_path / f"demo-{seed}" / "results", **override)
        (tmp_path / f"demo-{seed}" / "demo.json").write_text(json.dumps({"seed": seed, "quick": False}))
    saved = tmp_path / "demo-1" / "report" / "claims.json"
    saved.parent.mkdir()
    write_json_atomic(saved, [c.to_json() for c in paper_claims(load_results(tmp_path / "demo-1" / "results"))])
    computed = json.loads(runner.invoke(app, ["claims", str(tmp_path / "demo-0"), str(tmp_path / "demo-1"), "--format", "json"]).output)
    shutil.rmtree(tmp_path / "demo-1" / "results")

    res = runner.invoke(app, ["claims", str(tmp_path / "demo-0"), str(saved), "--format", "json"])
    assert res.exit_code == 0, res.output
    got = json.loads(res.output)
    assert got["claims"] == computed["claims"] and got["gate_head_to_head"] == computed["gate_head_to_head"]
    assert [(r["label"], r["claims_hold"], r["verdicts"]) for r in got["runs"]] == [
        ("seed 0", 7, "computed from results"), ("seed 1", 6, "read from claims.json")]
    md = runner.invoke(app, ["claims", str(tmp_path / "demo-0"), str(saved), "--format", "markdown"]).output
    assert "| Claim | seed 0 | seed 1 | Holds in | The paper |" in md
    assert "Read as saved in their claims.json, not computed from results: seed 1." in md
    assert "not computed" not in runner.invoke(app, ["claims", str(tmp_path / "demo-0"), "--format", "markdown"]).output

    # the directory without its results: one line naming the saved file
    from helpers import main_exit_code

    assert main_exit_code(["claims", str(tmp_path / "demo-1")]) == 2
    assert f"or {saved} to read its saved verdicts" in capsys.readouterr().err
    # another version's claims (a threshold changed, a claim missing), another JSON file, not JSON: refused
    claims = json.loads(saved.read_text())
    other = tmp_path / "other.json"
    for text in (json.dumps([dict(claims[0], threshold="MELT / teacher >= 0.80, cache = 1/T"), *claims[1:]]),
                 json.dumps(claims[:-1]), json.dumps({"seed": 1}), json.dumps([{"claim": c["claim"]} for c in claims]),
                 json.dumps([dict(claims[0], holds="yes"), *claims[1:]]),  # would be a KeyError in the table
                 json.dumps([*claims[:4], dict(claims[4], values={"pass@1": {"elementwise": "45", "scalar": 0.4}}),
                             *claims[5:]]),  # would be a TypeError in the gate pairs
                 "not json"):
        other.write_text(text)
        assert_one_line_error(capsys, ["claims", str(other)])


def test_claims_refuse_a_run_given_twice_quick_beside_full_damaged_results_and_impossible_scores(tmp_path, capsys):
    """What would change "holds in" without a word: a run counted twice (however its path is spelled), a --quick
    demo's meaningless numbers beside full runs, a claim read as "not run" where its results are damaged, and a
    saved gate score outside 0-1 (NaN among them)."""
    from melt_eval.files import write_json_atomic
    from melt_eval.report.claims import paper_claims

    for seed, quick in ((0, False), (1, False), (2, True)):
        _demo_like_results(tmp_path / f"demo-{seed}" / "results")
        (tmp_path / f"demo-{seed}" / "demo.json").write_text(json.dumps({"seed": seed, "quick": quick}))
    saved = tmp_path / "demo-0" / "report" / "claims.json"
    saved.parent.mkdir()
    write_json_atomic(saved, [c.to_json() for c in paper_claims(load_results(tmp_path / "demo-0" / "results"))])
    d0, d1, d2 = (str(tmp_path / f"demo-{s}") for s in range(3))
    for twice in ([d0, d0 + "/"], [d0, str(saved)], [str(saved), str(saved)], [d0, d1, str(tmp_path / "demo-1" / ".")], [d0 + "/results", d0]):
        assert "are the same run" in assert_one_line_error(capsys, ["claims", *twice])
    assert "is a --quick demo, beside full ones" in assert_one_line_error(capsys, ["claims", d0, d2])
    assert runner.invoke(app, ["claims", d0, d1]).exit_code == 0

    damaged = tmp_path / "demo-1" / "results" / "ablations" / "gates" / "mean" / "synthetic" / "results.json"
    damaged.write_text("{bad")
    err = assert_one_line_error(capsys, ["claims", d0, d1])
    assert str(damaged) in err and "not decided from damaged results" in err

    claims = json.loads(saved.read_text())
    gate = next(i for i, c in enumerate(claims) if c["values"].get("pass@1", {}).get("elementwise") is not None)
    for bad in (57.0, -0.1, float("nan"), float("inf")):
        scores = dict(claims[gate]["values"]["pass@1"], scalar=bad)
        saved.write_text(json.dumps([*claims[:gate], dict(claims[gate], values={"pass@1": scores}), *claims[gate + 1:]]))
        assert "does not hold this version's" in assert_one_line_error(capsys, ["claims", str(saved)])


def test_claims_refuse_a_copied_run_escape_file_text_and_check_every_saved_number(tmp_path, capsys):
    """Issue 69: a copy of a run (cp -r, or its claims.json elsewhere) is not a second run; a brief or a label from a
    file cannot drive the terminal; a saved NaN, Infinity or impossible number is refused and the JSON printed is
    strict."""
    from melt_eval.jsonio import dumps, write_json_strict
    from melt_eval.report.claims import paper_claims

    for seed, override in ((0, {}), (1, {"gates/scalar": 0.48})):
        _demo_like_results(tmp_path / f"demo-{seed}" / "results", **override)
        (tmp_path / f"demo-{seed}" / "demo.json").write_text(json.dumps({"seed": seed, "quick": False}))
    saved = tmp_path / "demo-0" / "report" / "claims.json"
    saved.parent.mkdir()
    write_json_strict(saved, [c.to_json() for c in paper_claims(load_results(tmp_path / "demo-0" / "results"))])
    d0, d1 = str(tmp_path / "demo-0"), str(tmp_path / "demo-1")
    shutil.copytree(d0, tmp_path / "demo-0-copy")
    (tmp_path / "elsewhere").mkdir()
    shutil.copy(saved, tmp_path / "elsewhere" / "claims.json")
    err = assert_one_line_error(capsys, ["claims", d0, d1, str(tmp_path / "demo-0-copy")])
    assert f"{d0} and {tmp_path / 'demo-0-copy'} are the same run (seed 0, the same settings and the same results)" in err
    err = assert_one_line_error(capsys, ["claims", str(tmp_path / "elsewhere" / "claims.json"), d0])
    assert "are the same run (the same results to the last digit)" in err
    # the same seed with other figures (another float path) is a second run; other seeds with equal figures too
    (tmp_path / "demo-1" / "demo.json").write_text(json.dumps({"seed": 0, "quick": False}))
    assert runner.invoke(app, ["claims", d0, d1]).exit_code == 0
    shutil.rmtree(tmp_path / "demo-1" / "results")
    shutil.copytree(tmp_path / "demo-0" / "results", tmp_path / "demo-1" / "results")
    (tmp_path / "demo-1" / "demo.json").write_text(json.dumps({"seed": 1, "quick": False}))
    assert runner.invoke(app, ["claims", d0, d1]).exit_code == 0

    # escape sequences in a saved brief and in a directory's name (rich markup too): printed as escapes
    claims = json.loads(saved.read_text())
    hostile = tmp_path / "run-\x1b[2J-[bold]"
    (hostile / "report").mkdir(parents=True)
    (hostile / "report" / "claims.json").write_text(json.dumps([dict(claims[0], brief="\x1b[2J\x1b]0;owned\x07\nrow"),
                                                                *claims[1:]]))
    for fmt in ("table", "markdown", "latex"):
        res = runner.invoke(app, ["claims", d1, str(hostile / "report" / "claims.json"), "--format", fmt])
        assert res.exit_code == 0, res.output
        assert not any(c in res.output for c in "\x1b\x07"), repr(res.output)
        assert "2J" in res.output and "owned" in res.output and "row" in res.output and "-[bold]" in res.output
    md = runner.invoke(app, ["claims", d1, str(hostile / "report" / "claims.json"), "--format", "markdown"]).output
    assert "\\x1b[2J\\x1b]0;owned\\x07\\nrow" in md  # one row: the newline escaped too
    assert "| run-\\x1b[2J-[bold] |" in md
    res = runner.invoke(app, ["claims", d1, str(hostile / "report" / "claims.json"), "--format", "json"])
    assert json.loads(res.output)["claims"][0]["runs"][1]["brief"] == "\x1b[2J\x1b]0;owned\x07\nrow"

    # every saved number: finite and in its range, wherever it is in a claim's values
    gate = next(i for i, c in enumerate(claims) if c["claim"] == "The element-wise gate is the best gate")
    bad_values = [(0, "ratio", float("nan")), (0, "ratio", float("inf")), (0, "melt_pass@1", 1.5), (0, "loops", True),
                  (0, "loops", 2.5), (0, "tasks", [float("nan")]), (3, "drops_in_stderr", {"-align": float("-inf")}),
                  (gate, "stderr", {"elementwise": -0.01}), (5, "cache_mb", [1.0, "x"]), (0, "melt", 3)]
    for i, key, value in bad_values:
        saved.write_text(json.dumps([*claims[:i], dict(claims[i], values=dict(claims[i]["values"], **{key: value})),
                                     *claims[i + 1:]]))
        err = assert_one_line_error(capsys, ["claims", str(saved)])
        assert "does not hold this version's" in err and f"claim {i + 1}: values.{key}" in err, (key, err)
    saved.write_text(json.dumps(claims))
    assert runner.invoke(app, ["claims", str(saved), d1]).exit_code == 0

    # a demo.json's seed and flags, and a results.json's numbers, as the harness writes them
    for record in ({"seed": True}, {"seed": -1}, {"seed": "\x1b[2J"}, {"seed": 2**40}, {"seed": 1, "quick": "no"}):
        (tmp_path / "demo-1" / "demo.json").write_text(json.dumps(record))
        err = assert_one_line_error(capsys, ["claims", d0, d1])
        assert "demo.json holds" in err and "\x1b" not in err
    (tmp_path / "demo-1" / "demo.json").write_text(json.dumps({"seed": 1, "quick": False, "float_path": {"kernels": [1]}}))
    assert "records float_path.kernels as [1]" in assert_one_line_error(capsys, ["claims", d0, d1])
    (tmp_path / "demo-1" / "demo.json").write_text(json.dumps({"seed": 1, "quick": False, "float_path": {"kernels": "\x1b[2J"}}))
    from helpers import main_exit_code

    assert main_exit_code(["claims", d0, d1]) == 0
    note = capsys.readouterr().err
    assert "different float paths" in note and "seed 1: \\x1b[2J kernels" in note and "\x1b" not in note
    (tmp_path / "demo-1" / "demo.json").write_text(json.dumps({"seed": 1, "quick": False}))
    one = tmp_path / "demo-1" / "results" / "melt-tiny" / "synthetic" / "results.json"
    good = json.loads(one.read_text())
    for change, said in (({"wall_time_s": float("nan")}, "wall_time_s is nan"),
                         ({"settings": {"loops": 0}}, "settings.loops is 0"),
                         ({"peak_cache_bytes": -1}, "peak_cache_bytes is -1")):
        one.write_text(json.dumps(good | change))
        err = assert_one_line_error(capsys, ["claims", d0, d1])
        assert said in err and "not decided from damaged results" in err
    one.write_text(json.dumps(good))

    # the JSON printed is strict: parsed without NaN or Infinity; a number that is not finite prints as null
    res = runner.invoke(app, ["claims", d0, d1, "--format", "json"])
    assert res.exit_code == 0 and json.loads(res.output, parse_constant=lambda c: pytest.fail(c))["runs"]
    assert dumps({"a": float("nan"), "b": [float("inf"), 1.5]}) == '{"a": null, "b": [null, 1.5]}'


def test_mistakes_table_counts_where_each_wrong_reply_first_goes_wrong(tmp_path):
    """From each evaluation's details.jsonl beside its results.json, against the synthetic test split: wrong
    replies by first mistake, problems never right, right answers reached through a wrong step."""
    from melt_eval import synthetic
    from melt_eval.evaluation.tasks import SYNTHETIC_TEST

    rows = synthetic.make_split("test", **SYNTHETIC_TEST)
    _demo_like_results(tmp_path)

    def details(rel: str, replies_by_index: dict[int, list[str]], gold=None) -> None:
        lines = []
        for i, replies in replies_by_index.items():
            g = gold or rows[i]["answer"]
            done = [{"text": t, "extracted": None, "correct": t.endswith(f"\\boxed{{{g}}}.")} for t in replies]
            lines.append(json.dumps({"index": i, "id": None, "gold": g, "completions": done}))
        (tmp_path / rel / "details.jsonl").write_text("\n".join(lines) + "\n")

    right0, right1 = rows[0]["solution"], rows[1]["solution"]
    boxed_wrong = right0.rsplit("\\boxed", 1)[0] + "\\boxed{0}."
    lucky = "1 y y y The answer is \\boxed{" + rows[1]["answer"] + "}."
    details("ablations/gates/elementwise/synthetic", {0: [right0, boxed_wrong], 1: [lucky, "garbage"]})
    details("ablations/gates/mean/synthetic", {0: [boxed_wrong, boxed_wrong], 1: [right1, right1]})
    details("ablations/gates/scalar/synthetic", {0: [right0]}, gold="no such answer")  # not this split: left out
    table = next(t for t in build_tables(load_results(tmp_path)) if t.key == "mistakes")
    assert table.title == "Where the wrong answers go wrong (synthetic task, 4 replies each)"
    assert table.heads == ["Wrong", "Never right", "format", "copy", "sum", "steps", "answer", "Right, flawed"]
    got = {r.stub[0]: [c.text for c in r.cells] for r in table.rows}
    assert got == {"gates: elementwise": ["2", "0", "1", "0", "0", "0", "1", "1"],
                   "gates: mean": ["2", "1", "0", "0", "0", "0", "2", "0"]}
    write_report(tmp_path, tmp_path / "r", plots=False)
    assert "### Where the wrong answers go wrong (synthetic task, 4 replies each)" in (tmp_path / "r" / "report.md").read_text()
    # results without details files (or of no synthetic task): no table
    _demo_like_results(tmp_path / "plain")
    assert "mistakes" not in {t.key for t in build_tables(load_results(tmp_path / "plain"))}


def test_demo_report_names_the_models_that_produced_the_numbers(tmp_path):
    _demo_like_results(tmp_path)
    tables = {t.key: t for t in build_tables(load_results(tmp_path))}
    assert "main" not in tables  # no result on the paper's benchmarks: no all-n/a table
    kv = tables["kv-sharing"]
    assert kv.title == "Untrained KV sharing on ouro-tiny" and kv.stub_heads == ["Model", "Paper's row"]
    assert [r.stub for r in kv.rows][:2] == [["ouro-tiny", "Ouro-1.4B-Thinking"],
                                             ["ouro-tiny, last loop (w/ prefill)", "Last loop (w/ prefill)"]]
    assert tables["components"].rows[0].stub == ["melt-tiny", "MELT-1.6B"]
    assert tables["gates"].rows[0].stub == ["melt-tiny (P1, elementwise)", "MELT-1.6B (P1)"]
    assert [r.stub for r in tables["other"].rows] == [["melt-tiny", "MELT-1.6B"], ["ouro-tiny", "Ouro-1.4B-Thinking"]]
    md = write_report(tmp_path, tmp_path / "r", plots=False)
    text = (tmp_path / "r" / "report.md").read_text()
    claims = text.split("### Gate ablation")[0]
    assert text.startswith("### Paper claims") and "| melt-tiny 50.0 / ouro-tiny 52.0 = 0.96; cache 0.250x at T = 4 |" in claims


def test_the_report_layer_never_imports_vllm():
    """`--measure vllm` is wired in the command module; no report library module imports vLLM or its backend,
    not even inside a function."""
    import ast

    import melt_eval.report

    for path in Path(melt_eval.report.__file__).parent.glob("*.py"):
        if path.name == "cli.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any("vllm" in n for n in names), f"{path.name} imports {names}"


def test_the_teacher_needs_its_loops_claim(tmp_path):
    from melt_eval.report.claims import paper_claims

    # the teacher at T = 1 scores 26.0 against 52.0 at T = 4: exactly half, the threshold, holds
    _demo_like_results(tmp_path / "half", **{"ouro-T1": 0.26})
    needs = paper_claims(load_results(tmp_path / "half"))[6]
    assert needs.claim == "The teacher needs its loops" and needs.holds
    assert needs.values["model"] == "ouro-tiny" and needs.values["loops"] == [1, 2, 3, 4]
    assert needs.values["pass@1"] == pytest.approx([0.26, 0.3, 0.4, 0.52]) and needs.values["ratio"] == pytest.approx(0.5)
    assert needs.measured == "ouro-tiny pass@1 26.0 at T = 1, 52.0 at T = 4 = 0.50" and needs.brief == "26.0 / 52.0 = 0.50"
    assert needs.paper is None and needs.paper_holds is None  # the paper has no Ouro at T = 1
    # a teacher that solves the task in one loop (the digit-sum demo's 98% at T = 1) does not need them
    _demo_like_results(tmp_path / "one", **{"ouro-T1": 0.51})
    assert paper_claims(load_results(tmp_path / "one"))[6].holds is False
    # without the teacher's T = 1 evaluation (demo --quick runs T = 2 and 4) no verdict: n/a, and the reason
    _demo_like_results(tmp_path / "none")
    shutil.rmtree(tmp_path / "none" / "loops" / "ouro-tiny-T1")
    missing = paper_claims(load_results(tmp_path / "none"))[6]
    assert missing.holds is None and missing.measured == "ouro-tiny not evaluated at T = 1 (only T = 2, 3, 4)"
