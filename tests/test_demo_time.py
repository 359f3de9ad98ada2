"""benchmarks/demo_time.py's bookkeeping, without running a demo: the refusals, the resume from saved records, and
the ratio and estimate it reports (issue 51, item 5). The timing itself is the benchmark's, never a test's."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import demo_time  # noqa: E402


def record(label: str, wall: float, seed: int = 0, quick: bool = False) -> dict:
    return {"label": label, "seed": seed, "quick": quick, "commit": "0" * 40, "returncode": 0, "wall_s": wall}


def test_a_ref_that_names_no_commit_is_refused_in_one_line_before_anything_is_written(tmp_path, capsys):
    out = tmp_path / "timing"
    assert demo_time.main(["--out", str(out), "--ref", "no-such-commit"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: 'no-such-commit' is not a commit") and "\n" not in err
    assert not out.exists()


def test_two_saved_records_are_read_not_run_again_and_give_the_ratio_and_the_estimate(tmp_path, capsys):
    (tmp_path / "current.json").write_text(json.dumps(record("current", 1000.0)))
    (tmp_path / "ref.json").write_text(json.dumps(record("ref", 1250.0)))
    assert demo_time.main(["--out", str(tmp_path), "--reference-wall", "874"]) == 0
    result = json.loads((tmp_path / "demo_time.json").read_text())
    assert result["ratio"] == 0.8 and result["estimate_s"] == 699.2  # 0.8 x 874
    assert result["runs"]["ref"]["wall_s"] == 1250.0
    assert "would take about 699 s" in capsys.readouterr().out
    assert not list(tmp_path.glob("demo-*")) and not list(tmp_path.glob("ref-*"))  # no demo ran, no worktree was made


def test_a_saved_record_of_another_demo_is_refused_not_mixed_into_the_ratio(tmp_path, capsys):
    (tmp_path / "current.json").write_text(json.dumps(record("current", 1000.0, quick=True)))
    (tmp_path / "ref.json").write_text(json.dumps(record("ref", 1250.0, quick=True)))
    assert demo_time.main(["--out", str(tmp_path)]) == 2  # the full demo asked, quick ones saved
    assert "timed another demo" in capsys.readouterr().err
    assert not (tmp_path / "demo_time.json").exists()
    assert demo_time.main(["--out", str(tmp_path), "--reference-wall", "0"]) == 2
    assert demo_time.main(["--out", str(tmp_path), "--seed", "-1"]) == 2
