"""The float path (melt_eval/float_path.py, docs/reproducibility.md): a seed gives the same bits in processes that
see different machines (vector width, core count), the bits are the published ones, and where a process cannot
give them it says so first."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from melt_eval import float_path

from helpers import main_exit_code

# `melt-eval train --recipe tiny-phase1 --from tiny-random-ouro --max-steps 4`'s model.safetensors and
# `melt-eval run synthetic --model tiny-random-melt --limit 4 --samples 4 --max-new-tokens 24`'s completions.jsonl,
# as the pinned float path computes them (docs/reproducibility.md#what-is-checked). Any x86-64 CPU with AVX2 must
# compute these bytes; a machine that does not has found a kernel the pin does not cover.
PUBLISHED_TRAINED_SHA256 = "d2a83d068ad08c9d06d97eb366f8c0403d4558991c3e49927a247c69002279a2"
PUBLISHED_COMPLETIONS_SHA256 = "5cbc95bbdb7611ce8fea198810d619bfa3ccf32d58bb3262642abd6d132c06de"

PIN_VARIABLES = (*float_path.PINNED, float_path.THREADS_VARIABLE, float_path.SWITCH, "ONEDNN_MAX_CPU_ISA")


def _cores() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def machines() -> dict[str, tuple[list[str], dict]]:
    """Processes that see different machines: (command prefix, environment variables set by the 'user')."""
    cores = _cores()
    avx2_only = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    seen = {"native": ([], {}), "avx2-only CPU (ATen, MKL, oneDNN capped)": ([], avx2_only),
            "one core": (["taskset", "-c", str(cores[0])], {})}
    if len(cores) >= 2:
        seen["two cores"] = (["taskset", "-c", f"{cores[0]},{cores[1]}"], {})
    return seen


# What a user's shell holds: none of the test session's own settings (other tests set thread or launcher
# variables in this process), only the test home and the offline switches
SHELL = ("PATH", "HOME", "LANG", "TMPDIR", "MELT_EVAL_HOME", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")


def user_env(extra: dict) -> dict:
    return {**{k: os.environ[k] for k in SHELL if k in os.environ}, **extra}


def run_as(machine: tuple[list[str], dict], *args: str) -> subprocess.CompletedProcess:
    prefix, extra = machine
    return subprocess.run([*prefix, sys.executable, "-m", "melt_eval.cli", *args], env=user_env(extra),
                          capture_output=True, text=True, timeout=900)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def taskset():
    if subprocess.run(["taskset", "-c", str(_cores()[0]), "true"], capture_output=True).returncode != 0:
        pytest.skip("taskset is not available")


def test_four_training_steps_give_the_published_bytes_on_every_machine(tmp_path, taskset):
    digests = {}
    for name, machine in machines().items():
        out = tmp_path / name.replace(" ", "-")
        done = run_as(machine, "train", "--recipe", "tiny-phase1", "--from", "tiny-random-ouro", "--max-steps", "4",
                      "--no-progress", "--output", str(out))
        assert done.returncode == 0, done.stderr[-2000:]
        assert "note:" not in done.stderr, done.stderr  # every one of them can give the published bits
        digests[name] = sha256(out / "model.safetensors")
        recorded = json.loads((out / "melt_eval_training.json").read_text())["float_path"]
        assert (recorded["kernels"], recorded["mkl_cbwr"], recorded["threads"]) == ("AVX2", "AVX2", float_path.THREADS)
    assert len(set(digests.values())) == 1, digests
    assert next(iter(digests.values())) == PUBLISHED_TRAINED_SHA256, digests


def test_a_short_evaluation_writes_the_published_completions_on_every_machine(tmp_path, taskset):
    digests = {}
    for name, machine in machines().items():
        out = tmp_path / name.replace(" ", "-")
        done = run_as(machine, "run", "synthetic", "--model", "tiny-random-melt", "--limit", "4", "--samples", "4",
                      "--max-new-tokens", "24", "--output-dir", str(out))
        assert done.returncode == 0, done.stderr[-2000:]
        digests[name] = sha256(out / "tiny-random-melt" / "synthetic" / "completions.jsonl")
    assert len(set(digests.values())) == 1, digests
    assert next(iter(digests.values())) == PUBLISHED_COMPLETIONS_SHA256, digests


def test_the_thread_count_is_pinned_whatever_the_cores(taskset):
    """Without the pin a process on one core computes with one thread and one on two cores with two, and those
    round differently (the measurement behind the pin: docs/reproducibility.md); with it both take THREADS."""
    probe = ("import torch, json, os; from melt_eval import float_path; "
             "print(json.dumps(float_path.describe()))")
    for machine in machines().values():
        prefix, extra = machine
        # the CLI module pins on import, as every command's process does
        code = "import melt_eval.cli; " + probe
        seen = json.loads(subprocess.run([*prefix, sys.executable, "-c", code], env=user_env(extra),
                                         capture_output=True, text=True, check=True).stdout)
        assert (seen["threads"], seen["kernels"], seen["mkl_cbwr"]) == (float_path.THREADS, "AVX2", "AVX2"), seen


def test_a_users_own_setting_wins_and_the_switch_turns_the_pin_off(monkeypatch):
    for name in PIN_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    monkeypatch.delenv(float_path.SET_BY_PIN, raising=False)
    float_path.pin()
    assert os.environ["OMP_NUM_THREADS"] == "7" and os.environ["ATEN_CPU_CAPABILITY"] == "avx2"
    assert "OMP_NUM_THREADS=7 overrides the pinned float path" in float_path.notice()
    # what the pin set is told from the user's own, in this process and in a child that pins again
    assert float_path.set_by_user("OMP_NUM_THREADS") and not float_path.set_by_user("ATEN_CPU_CAPABILITY")
    float_path.pin()
    assert not float_path.set_by_user("MKL_CBWR") and not float_path.set_by_user("ONEDNN_MAX_CPU_ISA")

    for name in PIN_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(float_path.SWITCH, "native")
    float_path.pin()
    assert not any(name in os.environ for name in (*float_path.PINNED, float_path.THREADS_VARIABLE))
    assert "not pinned (MELT_EVAL_FLOAT_PATH=native)" in float_path.notice()


def test_a_misspelt_switch_is_refused_in_one_line_not_read_as_pinned():
    """MELT_EVAL_FLOAT_PATH=nativ kept the pin without a word: the user believed it off."""
    refused = run_as(([], {float_path.SWITCH: "nativ"}), "tasks")
    assert refused.returncode == 2 and refused.stdout == "", refused
    assert refused.stderr.strip().splitlines() == [
        f"error: {float_path.SWITCH}='nativ' is not a setting: set it to native to turn the pinned float path off, "
        "or unset it"]
    assert run_as(([], {float_path.SWITCH: "Native"}), "tasks").returncode == 0


def test_a_machine_that_cannot_give_the_published_bits_says_so_first_and_runs(tmp_path, capsys, monkeypatch):
    for name in PIN_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    float_path.pin()
    monkeypatch.setattr(float_path, "cpu_flags", lambda: {"sse2", "avx"})  # a CPU without AVX2
    code = main_exit_code(["score", "synthetic", "--completions", str(tmp_path / "none.jsonl")])
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("note: this CPU lacks AVX2 and FMA") and "need not match the published ones" in err[0]
    assert code == 2  # the command itself went on (and refused the missing file, as it would anyway)

    monkeypatch.setattr(float_path, "cpu_flags", lambda: {"avx2", "fma"})
    monkeypatch.setattr(float_path.platform, "machine", lambda: "aarch64")
    assert "aarch64 machine" in float_path.notice()
    monkeypatch.setattr(float_path.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(float_path, "_torch_version", lambda: "2.14.1+cu130")
    assert "torch 2.14.1+cu130" in float_path.notice()


def test_phase_1s_first_step_changes_no_weight(tmp_path):
    """At alpha = 0 the student is its teacher: the step's exact loss is 0, and no weight moves (before, AdamW
    turned the rounding of a -1e-9 loss into a learning-rate step in every weight)."""
    from safetensors.torch import load_file

    from melt_eval.modeling.loading import resolve_model_dir

    assert main_exit_code(["train", "--recipe", "tiny-phase1", "--from", "tiny-random-ouro", "--max-steps", "1",
                           "--no-progress", "--output", str(tmp_path / "one")]) == 0
    trained = load_file(tmp_path / "one" / "model.safetensors")
    source = load_file(resolve_model_dir("tiny-random-ouro") / "model.safetensors")
    shared = [k for k in source if k in trained]
    assert len(shared) > 10 and all(torch_equal(source[k], trained[k]) for k in shared)
    row = json.loads((tmp_path / "one" / "logs" / "metrics.jsonl").read_text().splitlines()[0])
    assert (row["loss"], row["kd"], row["alpha"], row["grad_norm"]) == (0.0, 0.0, 0.0, 0.0)


def torch_equal(a, b) -> bool:
    import torch

    return torch.equal(a, b)


def test_claims_says_when_the_runs_it_compares_came_from_different_float_paths():
    from melt_eval.report.claims import RunClaims, float_path_note

    pinned = {"pinned": True, "kernels": "AVX2", "mkl_cbwr": "AVX2", "threads": 2, "torch": "2.13.0+cpu", "mkl": "2024.2"}
    runs = [RunClaims("seed 0", Path("a"), [], float_path=pinned),
            RunClaims("seed 1", Path("b"), [], float_path=dict(pinned, cpu_vendor="GenuineIntel"))]
    assert float_path_note(runs) is None  # the CPU is information; what decides the bits is the same
    runs[1].float_path = dict(pinned, kernels="AVX512", mkl_cbwr=None, pinned=False)
    note = float_path_note(runs)
    assert note.startswith("note: these runs were computed on different float paths")
    assert "seed 1: AVX512 kernels, MKL_CBWR=None, 2 thread(s), torch 2.13.0+cpu, not pinned" in note
    runs[1].float_path = None  # a run from before the record
    assert "seed 1: not recorded" in float_path_note(runs)


def test_the_demo_says_whether_its_claims_are_the_published_ones_of_its_seed(tmp_path):
    from melt_eval.experiments import demo

    from conftest import REPO

    published = REPO / "docs" / "results" / "2026-12-07-float-path" / "seed0" / "report" / "claims.json"
    same = demo.published_match(0, published)
    assert same["matches"] is True and same["line"].startswith("this run matches the published numbers of seed 0")
    other = tmp_path / "claims.json"
    other.write_bytes(published.read_bytes().replace(b"78.3", b"78.4", 1))
    differs = demo.published_match(0, other)
    assert differs["matches"] is False and "does NOT match the published numbers of seed 0" in differs["line"]
    assert demo.published_match(12345, published)["matches"] is None
