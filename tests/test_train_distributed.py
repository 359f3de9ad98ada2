"""Issue 50: training on several processes (2 CPU ranks on gloo, started by torchrun) gives one process's result.

Two `torchrun --nproc_per_node 2` launches serve every test here (tests/distributed_runs.py trains a plan of
runs in one start-up): phase 1, phase 2 and the exit-gate recipe at alpha 1 (where the loss is not a
cancellation: near-zero KD loss at the first interpolation steps differs by float rounding alone), a run into a
directory another run holds, and a run whose rank 1 is killed with SIGKILL after a checkpoint; the second
launch resumes it. The one-process references run in this process.
"""

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from melt_eval.cli import app
from melt_eval.files import DirLock
from melt_eval.training import data, run_recipe
from melt_eval.training.config import load_recipe
from melt_eval.training.launch import batch_note, layout

REPO = Path(__file__).resolve().parents[1]
# 8 sequences of 64 slots per step: 4 per micro-batch, so one process accumulates 2 and two processes 1 each
FAST = {"seq_len": 64, "micro_batch_size": 4, "batch_tokens": 512, "warmup_steps": 1, "save_every": 2,
        "data": [{"source": "synthetic", "n": 100, "num_steps": 1}], "tensorboard": False, "interpolation_steps": 0}
RUNS = {  # name: (recipe, from, overrides)
    "phase1": ("tiny-phase1", "tiny-random-ouro", {**FAST, "max_steps": 4}),
    # the compiled layer step: one process adds weight gradients into .grad inside its compiled backward, two
    # processes leave them to autograd, whose accumulation DDP hooks (`compile_layer_step(grads_in_place=...)`)
    "phase1_compiled": ("tiny-phase1", "tiny-random-ouro", {**FAST, "max_steps": 2, "compile": True, "chunk_size": 16,
                                                            "prompt_as_one_chunk": False}),
    "phase2": ("tiny-phase2", "tiny-random-melt", {**FAST, "max_steps": 3, "teacher": "tiny-random-ouro"}),
    "exit_gate": ("tiny-exit-gate", "tiny-random-melt", {**{k: v for k, v in FAST.items() if k != "interpolation_steps"},
                                                         "max_steps": 3}),
}

pytestmark = pytest.mark.usefixtures("one_thread")


def torchrun(plan: list[dict], path: Path) -> subprocess.CompletedProcess:
    """One 2-rank launch of tests/distributed_runs.py over `plan`, importing this checkout's melt_eval."""
    path.write_text(json.dumps(plan))
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(REPO / "tests" / "distributed_runs.py"), str(path)],
                          env=env, capture_output=True, text=True, timeout=600)


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()]


def rank_record(run_dir: Path, rank: int) -> dict:
    return json.loads((run_dir / f"rank-{rank}.json").read_text())


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """The 2-rank runs: every recipe of RUNS, a refused run, and a killed run resumed by a second launch
    (plus copies of the killed run, taken before that, for the one-process resume tests)."""
    root = tmp_path_factory.mktemp("ranks")
    plan = [{"name": name, "recipe": recipe, "from": start, "output": str(root / name), "overrides": overrides}
            for name, (recipe, start, overrides) in RUNS.items()]
    plan.append({"name": "locked", "recipe": "tiny-phase1", "from": "tiny-random-ouro", "output": str(root / "locked"),
                 "overrides": {**FAST, "max_steps": 1}})
    plan.append({**plan[0], "name": "killed", "output": str(root / "killed"), "kill_rank1_after_save": 2})
    with DirLock(root / "locked", "training run"):  # another run writes there
        first = torchrun(plan, root / "plan1.json")
    assert first.returncode != 0 and (root / "killed" / "checkpoints" / "step-000002").is_dir(), first.stderr[-3000:]
    for copy in ("killed-1proc", "killed-refused"):
        shutil.copytree(root / "killed", root / copy)
    second = torchrun([{**plan[-1], "resume": True, "kill_rank1_after_save": None}], root / "plan2.json")
    assert second.returncode == 0, second.stderr[-3000:]
    return root


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The same runs in one process (accumulating 2 micro-batches), recording the examples each step drew."""
    root = tmp_path_factory.mktemp("one")
    drawn, original = [], data.DataStream.next

    def recording_next(self):
        ex = original(self)
        drawn.append(ex.input_ids)
        return ex

    data.DataStream.next = recording_next
    try:
        for name, (recipe, start, overrides) in RUNS.items():
            run_recipe(recipe, start, root / name, progress=False, overrides=overrides)
            (root / name / "drawn.json").write_text(json.dumps(drawn))
            drawn.clear()
    finally:
        data.DataStream.next = original
    return root


def close(a: float, b: float, rel: float = 1e-5) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b))


@pytest.mark.parametrize("name", list(RUNS))
def test_two_processes_give_one_process_result(launched, one_process, name):
    """Same global batch, alpha 1: loss (all-reduced, the global one) and gradient norm of steps 1-3 within 1e-5
    relative; two processes accumulating 1 micro-batch equal one accumulating 2. The run records its layout."""
    two, one = metrics(launched / name), metrics(one_process / name)
    for a, b in zip(two[:3], one[:3], strict=True):
        assert close(a["loss"], b["loss"]) and close(a["grad_norm"], b["grad_norm"]), (name, a["step"], a, b)
        assert a["tokens"] == b["tokens"]
    lay = json.loads((launched / name / "melt_eval_training.json").read_text())["layout"]
    assert lay == {"world_size": 2, "distributed_type": "MULTI_CPU", "micro_batch_size": 4, "grad_accum_steps": 1,
                   "global_sequences_per_step": 8, "global_tokens_per_step": 512, "batch_tokens": 512, "warnings": []}
    assert json.loads((one_process / name / "melt_eval_training.json").read_text())["layout"]["grad_accum_steps"] == 2


def test_the_harness_launch_gives_one_process_result(one_process, tmp_path):
    """`melt-eval train --nproc-per-node 2` (issue 69 item 4): PyTorch's elastic launcher as torchrun starts it,
    torchrun's thread rule (a user who set no OMP_NUM_THREADS gets 1 per worker, not the command line's pinned 2),
    and the one process's losses and gradient norms."""
    recipe, start, overrides = RUNS["phase1"]
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    args = ["train", "--recipe", recipe, "--from", start, "--output", str(tmp_path / "p2"), "--no-progress",
            "--nproc-per-node", "2", *[a for k, v in overrides.items() for a in ("--set", f"{k}={json.dumps(v)}")]]
    done = subprocess.run([sys.executable, "-m", "melt_eval.cli", *args], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.stdout.count("trained model written to") == 1, done.stdout
    for a, b in zip(metrics(tmp_path / "p2")[:3], metrics(one_process / "phase1")[:3], strict=True):
        assert close(a["loss"], b["loss"]) and close(a["grad_norm"], b["grad_norm"]), (a["step"], a, b)
    meta = json.loads((tmp_path / "p2" / "melt_eval_training.json").read_text())
    assert meta["layout"]["world_size"] == 2 and meta["float_path"]["threads"] == 1


def test_ranks_share_each_step_without_duplicates_or_drops(launched, one_process):
    """Each step's examples on the two ranks are, together, exactly the one process's examples for that step."""
    ranks = [rank_record(launched / "phase1", r)["drawn"] for r in (0, 1)]
    one = json.loads((one_process / "phase1" / "drawn.json").read_text())
    assert len(ranks[0]) == len(ranks[1]) == 4 * 4 and len(one) == 4 * 8  # 4 steps x (4 per rank | 8)
    for step in range(4):
        both = ranks[0][step * 4:(step + 1) * 4] + ranks[1][step * 4:(step + 1) * 4]
        assert sorted(map(tuple, both)) == sorted(map(tuple, one[step * 8:(step + 1) * 8])), step


def test_each_rank_sees_every_example_once_per_epoch(tok):
    """Two ranks over one epoch of a 20-example source: every example once, on one rank only."""
    spec = [{"source": "synthetic", "n": 20, "num_steps": 1}]
    single = data.DataStream(spec, tok, 64, seed=0)
    epoch = sorted(tuple(single.next().input_ids) for _ in range(20))
    assert single.sources[0].epoch == 0 and single.sources[0].offset == 20
    ranks = [data.DataStream(spec, tok, 64, seed=0, rank=r, world_size=2) for r in (0, 1)]
    seen = [tuple(s.next().input_ids) for _ in range(10) for s in ranks]
    assert sorted(seen) == epoch and all(s.sources[0].offset == 20 for s in ranks)


@pytest.fixture(scope="module")
def tok():
    from melt_eval.modeling.loading import load_tokenizer, resolve_model_dir

    return load_tokenizer(resolve_model_dir("tiny-random-ouro"))


def test_a_second_run_on_the_directory_is_refused_on_every_rank(launched):
    """The lock belongs to the run: rank 0 is refused by the other run's lock, and rank 1 stops with the same line
    (it does not wait forever for a peer that exited)."""
    errors = [rank_record(launched / "locked", r)["error"] for r in (0, 1)]
    assert errors[0] == errors[1] and "is being written by another training run" in errors[0], errors
    assert not (launched / "locked" / "recipe.yaml").exists()


def test_kill9_of_one_rank_then_resume_gives_the_uninterrupted_result(launched):
    """Rank 1 killed with SIGKILL after step 2's checkpoint; --resume on 2 processes: the uninterrupted weights."""
    straight = load_file(launched / "phase1" / "model.safetensors")
    resumed = load_file(launched / "killed" / "model.safetensors")
    assert straight.keys() == resumed.keys()
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    assert [r["loss"] for r in metrics(launched / "killed")] == [r["loss"] for r in metrics(launched / "phase1")]


def test_a_two_process_checkpoint_resumes_on_one_process(launched):
    """The same global batch on another number of processes: the checkpoint resumes and ends where the
    uninterrupted 2-process run ends (within fp32 rounding of another reduction order)."""
    recipe, start, overrides = RUNS["phase1"]
    run_recipe(recipe, start, launched / "killed-1proc", progress=False, overrides=overrides, resume=True)
    straight = load_file(launched / "phase1" / "model.safetensors")
    resumed = load_file(launched / "killed-1proc" / "model.safetensors")
    assert all(torch.allclose(straight[k], resumed[k], rtol=1e-4, atol=1e-6) for k in straight)
    meta = json.loads((launched / "killed-1proc" / "melt_eval_training.json").read_text())
    assert meta["layout"]["world_size"] == 1 and meta["status"] == "finished"


def test_a_checkpoint_from_another_global_batch_is_refused_in_one_line(launched):
    """A checkpoint whose process count gives another global batch (here: recorded as 4 processes, 16 sequences
    per step) is refused before loading, naming both counts."""
    state_file = launched / "killed-refused" / "checkpoints" / "step-000002" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    state_file.write_text(json.dumps({**state, "world_size": 4}))
    recipe, start, overrides = RUNS["phase1"]
    args = ["train", "--recipe", recipe, "--from", start, "--output", str(launched / "killed-refused"), "--resume",
            "--no-progress", *[a for k, v in overrides.items() for a in ("--set", f"{k}={json.dumps(v)}")]]
    result = CliRunner().invoke(app, args)
    message = str(result.exception)
    assert "written by 4 processes" in message and "this run has 1" in message and "\n" not in message, result.output


def test_the_layout_is_checked_against_the_paper_batch():
    """32 x 10K tokens per step: 8 processes x micro-batch 1 reach it (accumulation 4); 3 processes cannot, and
    the line says which process counts can; 8 processes x micro-batch 3 get the micro-batches that fit."""
    paper = load_recipe("paper-phase1")

    class State:
        def __init__(self, n):
            self.num_processes, self.distributed_type = n, "FSDP"

    def note(n, **over):
        recipe = load_recipe("paper-phase1", overrides=over) if over else paper
        return batch_note(layout(State(n), recipe, recipe.grad_accum_steps(n)), recipe.seq_len)

    assert layout(State(8), paper, paper.grad_accum_steps(8))["global_tokens_per_step"] == 320_000
    assert note(8) is None and note(1) is None
    assert "run a number of processes that divides 32 sequences (1, 2, 4, 8, 16, 32)" in note(3)
    assert "set micro_batch_size to one of 1, 2, 4" in note(8, micro_batch_size=3)


def test_a_launch_that_started_fewer_processes_says_so(tmp_path, capsys, monkeypatch):
    """`accelerate launch --cpu --num_processes 2` starts one process (Accelerate's CPU launcher needs mpirun for
    more): the run says so in one line and records it."""
    monkeypatch.setenv("ACCELERATE_USE_CPU", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")  # what that launcher sets when asked for several processes
    recipe, start, overrides = RUNS["phase1"]
    run_recipe(recipe, start, tmp_path / "one", progress=False, overrides={**overrides, "max_steps": 1})
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: accelerate launch --cpu")]
    assert len(warnings) == 1 and "melt-eval train --nproc-per-node N" in warnings[0], warnings
    lay = json.loads((tmp_path / "one" / "melt_eval_training.json").read_text())["layout"]
    assert lay["world_size"] == 1 and lay["warnings"] == [warnings[0][len("warning: "):]]
    assert not math.isnan(metrics(tmp_path / "one")[0]["loss"])


def test_a_launch_asking_for_fsdp_never_falls_back_silently(tmp_path, monkeypatch):
    """`accelerate launch --config_file .../fsdp.yaml` on a machine where Accelerate sets up no FSDP (CPUs):
    one line saying what ran and which launcher to use instead, nothing written."""
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # what that launcher exports to every rank
    recipe, start, overrides = RUNS["phase1"]
    args = ["train", "--recipe", recipe, "--from", start, "--output", str(tmp_path / "fsdp"), "--no-progress"]
    result = CliRunner().invoke(app, args)
    message = str(result.exception)
    assert "asks for FSDP but Accelerate set up NO here" in message and "melt-eval train --nproc-per-node N" in message
    assert "\n" not in message and not (tmp_path / "fsdp").exists()
