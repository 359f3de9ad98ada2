"""The scripts under benchmarks/ are tools people run (issue 69, item 7): each refuses an argument no run could use
in one line (`_args.Parser`: argparse's error without its usage block; exit 2) before it builds, counts or times
anything, and each script that no other test runs runs here in its smallest case, so a change that breaks one is seen."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCHMARKS = REPO / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

# one argument (or a few, where the script needs others to get that far) each script must refuse
BAD = {
    "checker_memory": ["--bound-mib", "0"],
    "checkpoint_hash": ["--mib", "0"],
    "cli_start": ["--runs", "0"],
    "compiled_agreement": ["--steps", "0"],
    "cpu_capability": ["--problems", "0"],
    "decode": ["--hidden", "100"],
    "demo_speedups": ["--rounds", "-1"],
    "demo_time": ["--out", "{tmp}", "--reference-wall", "5e-324"],
    "dispatch": ["--count-layers", "1,1"],
    "dispatch_decode": ["--json", "{tmp}/no-such-directory/counts.json"],
    "early_exit": ["--new", "1"],
    "fsdp_cpu": ["--steps", "1"],
    "gpu": ["--budget-s", "nan"],
    "kv_quant": ["--contexts", "4096"],
    "same_bits": ["compare", "{tmp}/a.pt", "{tmp}/b.pt"],
    "sandbox": ["--checks", "0"],
    "sandbox_spurious_failures": ["--checks", "0"],
    "train_memory": ["--seq-len", "10"],
    "train_side_by_side": ["--jobs", "0"],
    "train_throughput": ["--seq-len", "128", "--chunks", "128,512"],
    "vllm_throughput": ["--kv-budget-gb", "inf"],
}


def script(name: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return run_command([sys.executable, str(BENCHMARKS / f"{name}.py"), *args], timeout)


def run_command(command: list[str], timeout: float) -> subprocess.CompletedProcess:
    """`command` in a session of its own: on a timeout its whole process group goes (vLLM's engine processes and
    torchrun's workers would outlive their parent)."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def test_every_script_has_a_bad_argument_to_refuse():
    scripts = {p.stem for p in BENCHMARKS.glob("*.py") if not p.name.startswith("_")}
    assert scripts == set(BAD), "add the new script to BAD (and run it below if no other test does)"


def load(name: str):
    """A script as a module, under a name of its own (its main() reads sys.argv, as when it is run)."""
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", BENCHMARKS / f"{name}.py")
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_bad_argument_is_refused_in_one_line_before_any_work(name, tmp_path, monkeypatch, capsys):
    """In this process (a fresh interpreter per script would take most of a minute on a busy machine): main() ends
    with exit status 2 and argparse's error line, and any other exception fails the test as a traceback would."""
    main = load(name).main
    monkeypatch.setattr(sys, "argv", [f"{name}.py", *(a.replace("{tmp}", str(tmp_path)) for a in BAD[name])])
    with pytest.raises(SystemExit) as exc:
        sys.exit(main())  # demo_time returns its status
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines  # the error alone, no usage block above it
    last = lines[0]
    assert exc.value.code == 2 and (last.startswith(f"{name}.py") and ": error: " in last or last.startswith("error: ")), last
    assert not list(tmp_path.iterdir()), "nothing is written before the arguments are checked"


def test_a_refusal_as_a_user_meets_it():
    """The same through a fresh interpreter, for the case issue 69 reported: exit 2, one error line, no traceback."""
    run = script("dispatch", "--layers", "0", timeout=120)
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr[-3000:]
    assert run.stderr.strip().splitlines() == [
        "dispatch.py: error: argument --layers: must be a whole number of at least 1, got '0' (--help lists the options)"]


def test_dispatch_refuses_depths_it_cannot_count_and_a_json_it_cannot_write(tmp_path, capsys):
    """Issue 69: --layers 0 or negative, --count-layers 1 (one depth) or 1,1 (no line through one point twice) and
    an unwritable --json ended in tracebacks, the last two only after the whole count."""
    import dispatch

    (tmp_path / "a-dir").mkdir()
    for argv in (["--layers", "0"], ["--layers", "-3"], ["--count-layers", "1"], ["--count-layers", "1,1"],
                 ["--count-layers", "0,2"], ["--count-layers", "a,b"], ["--json", str(tmp_path / "no" / "x.json")],
                 ["--json", str(tmp_path / "a-dir")], ["--sections", "nope"]):
        with pytest.raises(SystemExit) as exc:
            dispatch.main(argv)
        assert exc.value.code == 2, argv
        assert "error: " in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-dir"]  # the check leaves no file behind


def test_the_shared_argument_types():
    import argparse

    from _args import number, output_file, whole, wholes

    assert whole(1)("3") == 3 and wholes(1, count=2, distinct=True)("1,2") == (1, 2) and number(0, above=True)("0.5") == 0.5
    for parse, text in ((whole(1), "0"), (whole(1), "1.5"), (whole(1, 4), "5"), (number(0, above=True), "0"),
                        (number(), "nan"), (number(), "inf"), (wholes(1), "1,,2"), (wholes(count=2), "1,2,3"),
                        (output_file, ""), (output_file, "/proc/no-such/x")):
        with pytest.raises(argparse.ArgumentTypeError):
            parse(text)


# --- the scripts no other test runs, in their smallest case -------------------------------------------------------


def test_checkpoint_hash_runs():
    run = script("checkpoint_hash", "--mib", "1", "--repeats", "1")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "sha256:" in run.stdout and "to hash" in run.stdout


def test_cli_start_runs_without_dropping_the_page_cache():
    run = script("cli_start", "--before", str(REPO), "--runs", "1", "--keep-page-cache")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "melt-eval tasks" in run.stdout and " kept " in run.stdout and "dropped" not in run.stdout.split("load after")[1]


def test_sandbox_spurious_failures_runs():
    run = script("sandbox_spurious_failures", "--checks", "1", "--backend", "launcher")
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout.splitlines()[-1])["launcher"]["failed"] == 0


def test_train_throughput_runs():
    run = script("train_throughput", "--quick", "--seq-len", "32", "--chunks", "8", "--steps", "1", "--json",
                 "--device", "cpu")
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout)
    assert [r["chunk_size"] for r in result["rows"]] == [None, 8, 32] and result["per_chunk_s"] == result["per_chunk_s"]


def test_train_side_by_side_runs():
    run = script("train_side_by_side", "--runs", "1", "--jobs", "1", "--steps", "1", "--json")
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout.splitlines()[-1])["runs"] == 1


def test_demo_speedups_runs():
    run = script("demo_speedups", "--steps", "1", "--rounds", "1", "--problems", "1", "--sequences", "2", "--json")
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.splitlines()[-1])
    assert len(out["training_step_s"]) == 2 and len(out["generation_s"]) == 3


def test_fsdp_cpu_runs_on_two_ranks():
    run = run_command([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                       str(BENCHMARKS / "fsdp_cpu.py")], timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout[run.stdout.index("{"):])
    assert out["world_size"] == 2 and [r["wrap"] for r in out["results"]] == ["one-unit", "per-layer"]


def test_vllm_throughput_runs_its_arithmetic_and_needs_vllm_for_the_rest():
    run = script("vllm_throughput", "--paper-shape", "--json")  # arithmetic: no vLLM needed
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout)["context"] == 32768
    if importlib.util.find_spec("vllm") is None:
        run = script("vllm_throughput", "--quick")
        assert run.returncode == 2 and "vLLM is not installed" in run.stderr, run.stderr


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_throughput_serves_both_models():
    """Four vLLM engines start, a probe and a run per model (a few minutes on a CPU): the smallest case that serves,
    a 1 MiB budget keeping the batch small."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed")
    run = script("vllm_throughput", "--quick", "--hidden", "64", "--layers", "1", "--prompt", "8", "--new", "8",
                 "--kv-budget-mb", "1", "--json", timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout[run.stdout.index("{"):])["kv_per_token_ratio"] > 1  # MELT's cache is the smaller
