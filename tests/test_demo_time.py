"""benchmarks/demo_time.py's bookkeeping, without running a demo: the refusals, the resume from saved records, and
the ratio and estimate it reports (issue 51, item 5). The timing itself is the benchmark's, never a test's."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import demo_time  # noqa: E402


@pytest.fixture(autouse=True)
def no_demo(monkeypatch):
    """A test that reached a real demo (20 minutes) fails at once instead."""
    def refuse_to_run(*args, **kwargs):
        raise AssertionError("a demo would have started")
    monkeypatch.setattr(demo_time, "time_demo", refuse_to_run)


def record(label: str, wall, seed: int = 0, quick: bool = False, commit: str | None = None) -> dict:
    """A saved record as the script writes it, of this checkout's HEAD (current) or of 7111383 (ref)."""
    commit = commit or (demo_time.git("rev-parse", "HEAD") if label == "current" else demo_time.resolve("7111383"))
    return {"label": label, "seed": seed, "quick": quick, "commit": commit, "returncode": 0, "wall_s": wall}


def refused(capsys, *args) -> str:
    """The one-line error of a call that must be refused (exit 2) before any demo runs."""
    assert demo_time.main(list(args)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err
    return err


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
    capsys.readouterr()
    # issue 69: a seed of true is not seed 1, a quick of 0 not false
    for seed, quick, said in ((True, False, "seed true, quick false"), (1.0, False, "seed 1.0"), (1, 0, "seed 1, quick 0")):
        for label in ("current", "ref"):
            (tmp_path / f"{label}.json").write_text(json.dumps(record(label, 1000.0, seed=seed, quick=quick)))
        assert f"timed another demo ({said}" in refused(capsys, "--out", str(tmp_path), "--seed", "1")


def test_a_saved_record_of_other_code_or_without_a_usable_time_is_refused_before_any_demo(tmp_path, capsys):
    """A record left from another --ref, an older HEAD, a killed write or a hand edit would put a ratio of other
    runs in the summary, or fail after the other demo's 20 minutes; each is refused in one line first."""
    good = json.dumps(record("current", 1000.0))
    (tmp_path / "current.json").write_text(good)
    (tmp_path / "ref.json").write_text(json.dumps(record("ref", 1250.0, commit="b" * 40)))
    assert "timed commit bbbbbbbbbbbb, not 7111383" in refused(capsys, "--out", str(tmp_path))
    (tmp_path / "ref.json").write_text(json.dumps(record("ref", 1250.0)))
    (tmp_path / "current.json").write_text(json.dumps(record("current", 1000.0, commit="a" * 40)))
    assert "timed commit aaaaaaaaaaaa" in refused(capsys, "--out", str(tmp_path))
    for bad in ('{"label": "current"', "[1, 2]", json.dumps(record("current", "abc")), json.dumps(record("current", 0)),
                json.dumps(record("current", -5.0)), json.dumps(record("current", None)),
                json.dumps(record("current", 5e-324)), json.dumps(record("current", 1e308)),  # ratio inf or 0 (issue 69)
                json.dumps(record("current", True))):
        (tmp_path / "current.json").write_text(bad)
        assert "delete it to time the current run again" in refused(capsys, "--out", str(tmp_path))
    # ref first: the current run's bad record is refused before the ref demo would start
    (tmp_path / "ref.json").unlink()
    assert "current.json" in refused(capsys, "--out", str(tmp_path), "--order", "ref-first")
    assert not list(tmp_path.glob("demo-*")) and not list(tmp_path.glob("ref-*")) and not (tmp_path / "demo_time.json").exists()


def test_arguments_no_demo_could_use_are_refused_in_one_line(tmp_path, capsys):
    (tmp_path / "current.json").write_text(json.dumps(record("current", 1000.0)))
    (tmp_path / "ref.json").write_text(json.dumps(record("ref", 1250.0)))
    for wall in ("nan", "inf", "-inf", "5e-324", "1e300"):
        assert "--reference-wall" in refused(capsys, "--out", str(tmp_path), f"--reference-wall={wall}")
    assert "0 to 4294967295" in refused(capsys, "--out", str(tmp_path), "--seed", str(2**32))
    assert "--out is empty" in refused(capsys, "--out", "")
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    assert "cannot make --out" in refused(capsys, "--out", str(a_file))
    assert not (tmp_path / "demo_time.json").exists()
