"""`--prefill-chunk` defaults to what the checkpoint was trained with (issue 38 item 4): read from the
training record (melt_eval_training.json) a real tiny training run writes beside its model; an explicit
flag wins; without a record the default stays 1 (exact MELT), silently; `run` says where a recorded default came from
and results.json records the value used; `serve` passes the same default to vLLM."""

import json
import shutil

import pytest

from melt_eval.errors import UserError
from melt_eval.files import TRAINING_META
from melt_eval.generation.options import InferenceOptions, checkpoint_prefill_chunk, trained_prefill_chunk
from melt_eval.training import run_recipe

from helpers import main_exit_code as _main
from helpers import one_line_error as _one_line_error

# tiny-phase1 (prompt_as_one_chunk: true) shrunk to one optimiser step, as tests/test_train_run.py does
FAST = {"seq_len": 64, "micro_batch_size": 4, "batch_tokens": 256, "warmup_steps": 1, "max_steps": 1,
        "interpolation_steps": 0, "save_every": 0, "data": [{"source": "synthetic", "n": 40, "num_steps": 1}],
        "tensorboard": False}
RUN = ["--limit", "2", "--samples", "1", "--max-new-tokens", "4", "--temperature", "0", "--no-progress"]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Two MELT checkpoints from real one-step runs: the prompt as one chunk (seq_len 64), and chunks of 4."""
    root = tmp_path_factory.mktemp("trained")
    whole = run_recipe("tiny-phase1", "tiny-random-ouro", root / "whole", progress=False, overrides=FAST)
    chunked = run_recipe("tiny-phase1", "tiny-random-ouro", root / "chunk4", progress=False,
                         overrides={**FAST, "prompt_as_one_chunk": False, "chunk_size": 4})
    return {"whole": whole, "chunk4": chunked}


def _settings(out, name):
    [path] = list(out.glob(f"{name}/synthetic/results.json"))
    return json.loads(path.read_text())["settings"]


def _completions(out, name):
    return (out / name / "synthetic" / "completions.jsonl").read_text()


def test_training_writes_the_record_the_default_reads(trained):
    recipe = json.loads((trained["whole"] / TRAINING_META).read_text())["recipe"]
    assert recipe["prompt_as_one_chunk"] is True and recipe["seq_len"] == 64
    assert checkpoint_prefill_chunk(trained["whole"])[0] == 64  # the prompt whole: a chunk of seq_len
    assert checkpoint_prefill_chunk(trained["chunk4"])[0] == 4


def test_run_defaults_to_the_trained_chunk_and_says_so(trained, tmp_path, capsys):
    out = tmp_path / "out"
    assert _main(["run", "synthetic", "--model", trained["whole"], "--output", out, *RUN]) == 0
    err = capsys.readouterr().err
    [line] = [ln for ln in err.splitlines() if ln.startswith("--prefill-chunk")]
    assert line.startswith("--prefill-chunk 64: the prompt whole") and TRAINING_META in line
    assert _settings(out, "whole")["prefill_chunk"] == 64
    # the default generates exactly what the same chunk given by hand does
    assert _main(["run", "synthetic", "--model", trained["whole"], "--output", tmp_path / "explicit",
                  "--prefill-chunk", "64", *RUN]) == 0
    assert "--prefill-chunk" not in capsys.readouterr().err  # given: nothing to explain
    assert _completions(out, "whole") == _completions(tmp_path / "explicit", "whole")

    assert _main(["run", "synthetic", "--model", trained["chunk4"], "--output", out, *RUN]) == 0
    assert "--prefill-chunk 4: as trained (chunk_size 4)" in capsys.readouterr().err
    assert _settings(out, "chunk4")["prefill_chunk"] == 4


def test_explicit_flag_wins_over_the_record(trained, tmp_path, capsys):
    out = tmp_path / "out"
    assert _main(["run", "synthetic", "--model", trained["whole"], "--output", out, "--prefill-chunk", "3", *RUN]) == 0
    assert "--prefill-chunk" not in capsys.readouterr().err
    assert _settings(out, "whole")["prefill_chunk"] == 3


def test_without_a_record_the_default_is_exact_melt(tmp_path, capsys):
    out = tmp_path / "out"
    assert _main(["run", "synthetic", "--model", "tiny-random-melt", "--output", out, *RUN]) == 0
    assert "--prefill-chunk" not in capsys.readouterr().err  # no record: today's default, said nowhere
    assert checkpoint_prefill_chunk(tmp_path)[1].endswith(f"no training record ({TRAINING_META}) in {tmp_path}")
    assert _settings(out, "tiny-random-melt")["prefill_chunk"] == 1


def test_an_unreadable_record_stops_and_a_looplm_record_falls_back_to_one(trained, tmp_path):
    # issue 52: an unreadable record stops the run, as a damaged run.json does (it used to fall back to 1 with
    # "no readable recipe": the prefill chunk is part of the run's identity, so guessing it changes the results)
    broken = tmp_path / "broken"
    shutil.copytree(trained["whole"], broken, ignore=shutil.ignore_patterns("checkpoints", "logs"))
    (broken / TRAINING_META).write_text("{not json")
    with pytest.raises(UserError, match="not valid JSON.*pass --prefill-chunk N"):
        checkpoint_prefill_chunk(broken)
    # a plain LoopLM (pretrain-tiny) trains per-loop caches: no prompt chunk to follow
    assert trained_prefill_chunk({"target": "looplm", "chunk_size": 500}) is None
    assert trained_prefill_chunk({"target": "melt", "chunk_size": 0, "seq_len": 100})[0] == 100  # C = L
    options, line = InferenceOptions(prefill_chunk=2).for_checkpoint(trained["whole"])
    assert options.prefill_chunk == 2 and line is None


@pytest.mark.parametrize("field, value", [("chunk_size", -5), ("chunk_size", 1e18), ("chunk_size", "abc"),
                                          ("prompt_as_one_chunk", "yes"), ("target", 7)])
def test_a_bad_value_in_the_record_is_named_and_stops_the_run(trained, tmp_path, capsys, field, value):
    """Issue 52 item 3: each field of melt_eval_training.json that inference reads is checked; a bad one is
    named in one line and `run` stops (exit 2), as for a damaged run.json; --prefill-chunk runs without it."""
    damaged = tmp_path / "damaged"
    shutil.copytree(trained["chunk4"], damaged, ignore=shutil.ignore_patterns("checkpoints", "logs"))
    meta = json.loads((damaged / TRAINING_META).read_text())
    meta["recipe"].update({"prompt_as_one_chunk": False, field: value})
    (damaged / TRAINING_META).write_text(json.dumps(meta))
    code = _main(["run", "synthetic", "--model", damaged, "--output", tmp_path / "out", *RUN])
    _one_line_error(capsys, code, TRAINING_META, f"recipe field {field} is {value!r}", "--prefill-chunk")
    assert not (tmp_path / "out").exists()  # stopped before any result was written
    assert _main(["run", "synthetic", "--model", damaged, "--output", tmp_path / "out", "--prefill-chunk", "2",
                  *RUN]) == 0


def test_serve_passes_the_trained_chunk_to_vllm(trained):
    from melt_eval.serve import serve_command

    notes = []
    cmd = serve_command(str(trained["whole"]), on_cpu=True, note=notes.append)
    overrides = json.loads(cmd[cmd.index("--hf-overrides") + 1])
    assert overrides["melt_eval_prefill_chunk"] == 64 and notes[0].startswith("--prefill-chunk 64")
    cmd = serve_command(str(trained["whole"]), prefill_chunk=2, on_cpu=True, note=notes.append)
    assert json.loads(cmd[cmd.index("--hf-overrides") + 1])["melt_eval_prefill_chunk"] == 2 and len(notes) == 1
    assert "--hf-overrides" not in serve_command("tiny-random-melt", on_cpu=True)  # no record: vLLM's plugin default 1


def test_ablation_rows_keep_one_chunk_rule(trained, tmp_path, monkeypatch):
    """`ablate` evaluates every row with prefill chunk 1, as before this default: the rows compare training."""
    import melt_eval.evaluation as evaluation
    from melt_eval.experiments import ablations

    seen = []
    monkeypatch.setattr(evaluation, "run_tasks", lambda tasks, model, options, paths, **kw: seen.append(options) or [])
    ablations._evaluate(ablations.Evaluation(str(trained["whole"]), tmp_path / "r", "full"), "synthetic", "native",
                        False, {"samples": 1})
    assert seen[0].prefill_chunk == 1
