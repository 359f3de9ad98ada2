"""Recipe key stop_at_heldout (melt_eval/training/heldout.py): training stops once pass@1 on a held-out split,
disjoint from train and test, reaches a target; the stopped run is finished, its checks recorded, and a run
resumed between checks stops at the same step with the same weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from melt_eval import synthetic
from melt_eval.errors import UserError
from melt_eval.evaluation.tasks import SYNTHETIC_TEST
from melt_eval.training import heldout, run_recipe
from melt_eval.training.config import load_recipe
from melt_eval.training.runner import META_FILE

from helpers import checkpoint_layout

pytestmark = pytest.mark.usefixtures("one_thread")

SOURCE = load_recipe("pretrain-tiny").data[0]  # the demo teacher's task
# a from-scratch LoopLM shrunk to a second or so of steps
FAST = {"seq_len": 112, "micro_batch_size": 4, "batch_tokens": 448, "warmup_steps": 1, "max_steps": 12,
        "save_every": 1, "keep_checkpoints": 20, "tensorboard": False, "data": [dict(SOURCE, n=64)]}
STOP = {"loops": 4, "target": 0.5, "every": 2, "problems": 4}


def test_the_heldout_split_is_disjoint_from_train_and_test():
    rows = heldout.heldout_rows(SOURCE, 20)
    problems = {r["problem"] for r in rows}
    assert len(problems) == 20
    train = {r["problem"] for r in synthetic.make_split("train", SOURCE["n"], num_steps=tuple(SOURCE["num_steps"]),
                                                        max_value=SOURCE["max_value"], form=SOURCE["form"])}
    test = {r["problem"] for r in synthetic.make_split("test", **SYNTHETIC_TEST)}
    assert len(train) == 1173 and len(test) == 100  # the recipe trains on the whole train split
    assert not problems & train and not problems & test
    assert heldout.heldout_rows(SOURCE, 20) == rows  # fixed: every check and every run reads the same problems
    with pytest.raises(UserError, match="lower stop_at_heldout.problems"):
        heldout.heldout_rows(SOURCE, 40)  # the digit-sum task has 123 test-bucket problems, 100 of them the test's


@pytest.mark.parametrize("spec, message", [
    ("yes", "stop_at_heldout must be a mapping"),
    ({"loops": 4, "target": 0.8}, "missing every"),
    ({"loops": 4, "target": 0.8, "every": 50, "patience": 2}, r"unknown key\(s\) patience"),
    ({"loops": 0, "target": 0.8, "every": 50}, "loops must be a whole number >= 1"),
    ({"loops": 4, "target": 80, "every": 50}, r"target is a pass@1 within \(0, 1\]"),
    ({"loops": 4, "target": 0.8, "every": 2.5}, "every must be a whole number >= 1"),
])
def test_bad_stop_at_heldout_is_one_line_saying_what_to_set(spec, message):
    with pytest.raises(UserError, match=message):
        load_recipe("pretrain-tiny", overrides={"stop_at_heldout": spec})


def test_stop_at_heldout_needs_a_synthetic_source_and_a_model_target():
    with pytest.raises(UserError, match="has none"):
        load_recipe("pretrain-tiny", overrides={"stop_at_heldout": STOP, "data": [{"source": "local", "path": "x.jsonl"}]})
    with pytest.raises(UserError, match="trains only a gate"):
        load_recipe("tiny-exit-gate", overrides={"stop_at_heldout": STOP})


class FakeResult:
    def __init__(self, sequences):
        self.sequences = sequences


def test_the_check_scores_the_share_of_replies_boxing_the_gold_answer(monkeypatch):
    """pass@1 = right replies / (problems x samples), each reply's last \\boxed{} against the gold answer."""
    from transformers import AutoTokenizer

    from melt_eval.modeling.loading import load_looped, resolve_model_dir

    path = resolve_model_dir("tiny-random-ouro")
    tok = AutoTokenizer.from_pretrained(str(path))
    recipe = load_recipe("pretrain-tiny", overrides={"stop_at_heldout": {**STOP, "samples": 2}})
    check = heldout.HeldoutCheck(recipe, tok)
    gold = [r["answer"] for r in check.rows]
    wrong = [str(int(a) % 9 + 1) for a in gold]
    # problem i: both samples right for i = 0, one for i = 1, none for the rest -> 3 of 8
    replies = [[gold[0], gold[0]], [wrong[1], gold[1]], [wrong[2], wrong[2]], [wrong[3], wrong[3]]]
    calls = {}

    def fake_generate(model, prompts, options, **kw):
        calls.update(kw, loops=options.loops, prompts=prompts)
        return FakeResult([[tok.encode(f"so \\boxed{{7}} then \\boxed{{{a}}}") for a in row] for row in replies])

    monkeypatch.setattr("melt_eval.generation.engine.generate", fake_generate)
    model = load_looped(path)
    model.train()
    got = check.run(model, 6)
    assert got["pass@1"] == pytest.approx(3 / 8) and got["stop"] is False and got["step"] == 6
    assert model.training  # the training mode is given back
    assert calls["loops"] == 4 and calls["n"] == 2 and calls["temperature"] == 1.0 and calls["top_p"] == 0.7
    assert len(calls["prompts"]) == 4 and calls["max_new_tokens"] >= 60  # room for a 7-step worked reply
    assert heldout.answer("no box") is None


def _scripted(monkeypatch, stop_at: int) -> list[int]:
    """Each real check (the model generates on the held-out split) reports pass@1 1.0 from step `stop_at`
    on and 0.0 before: a tiny model learns nothing in 12 steps, and the runner's part is what is tested."""
    real = heldout.HeldoutCheck.run
    steps = []

    def run(self, model, step):
        got = real(self, model, step)
        steps.append(step)
        score = 1.0 if step >= stop_at else 0.0
        return {**got, "pass@1": score, "stop": score >= self.target}

    monkeypatch.setattr(heldout.HeldoutCheck, "run", run)
    return steps


def _train(out: Path, **kw) -> Path:
    overrides = {**FAST, "stop_at_heldout": STOP, **kw.pop("overrides", {})}
    return run_recipe("pretrain-tiny", "tiny-random-ouro", out, overrides=overrides, progress=False, **kw)


def test_a_run_stops_at_the_first_check_on_target_finished_and_recorded(tmp_path, monkeypatch, capsys):
    steps = _scripted(monkeypatch, stop_at=6)
    out = _train(tmp_path / "run")
    assert steps == [2, 4, 6]
    meta = json.loads((out / META_FILE).read_text())
    assert meta["status"] == "finished" and meta["steps"] == 6
    assert meta["heldout"]["stopped_at"] == 6
    assert [(c["step"], c["pass@1"], c["stop"]) for c in meta["heldout"]["checks"]] == [(2, 0.0, False), (4, 0.0, False),
                                                                                         (6, 1.0, True)]
    assert all(c["problems"] == 4 and c["loops"] == 4 for c in meta["heldout"]["checks"])
    records = [json.loads(line) for line in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == 6 and records[-1]["heldout"]["stop"] is True
    assert (out / "model.safetensors").exists() and (out / "README.md").exists()  # exported as a finished run
    assert "step 6: held-out pass@1 at T = 4 1.000 (target 0.5; stopping" in capsys.readouterr().out

    # the checks leave training alone: the same recipe without them, stopped at step 6, has the same weights
    plain = run_recipe("pretrain-tiny", "tiny-random-ouro", tmp_path / "plain", overrides=FAST, progress=False, stop_after=6)
    state = sorted((plain / "checkpoints").glob("step-000006/state/model.safetensors"))[0]
    _same_weights(load_file(out / "model.safetensors"), checkpoint_layout(load_file(state)))


def test_a_run_resumed_between_checks_stops_at_the_same_step_with_the_same_weights(tmp_path, monkeypatch):
    _scripted(monkeypatch, stop_at=8)
    straight = _train(tmp_path / "straight")
    out = tmp_path / "resumed"
    _train(out, stop_after=5)  # interrupted between the checks at 4 and 6
    assert json.loads((out / META_FILE).read_text())["status"] == "running"
    _train(out, resume=True)
    a, b = (json.loads((d / META_FILE).read_text()) for d in (straight, out))
    assert a["heldout"]["stopped_at"] == b["heldout"]["stopped_at"] == 8 and a["steps"] == b["steps"] == 8
    strip = lambda checks: [{k: v for k, v in c.items() if k != "seconds"} for c in checks]
    assert strip(a["heldout"]["checks"]) == strip(b["heldout"]["checks"]) and len(b["heldout"]["checks"]) == 4
    _same_weights(load_file(straight / "model.safetensors"), load_file(out / "model.safetensors"))


def test_a_run_killed_between_its_stop_and_its_export_resumes_to_the_same_stop(tmp_path, monkeypatch):
    """A check stopped the run at a step that was also a checkpoint step (save_every 1), and the process died
    before the export: --resume loaded that checkpoint, which does not say the run had stopped, and trained on to
    the next check (issue 69, hostile round 6: stopped at 8, finished at 10)."""
    from melt_eval.training import runner

    _scripted(monkeypatch, stop_at=8)
    straight = _train(tmp_path / "straight")
    out = tmp_path / "killed"
    real_export = runner.export

    def killed(*args, **kwargs):
        raise SystemExit("killed before the export")

    monkeypatch.setattr(runner, "export", killed)
    with pytest.raises(SystemExit):
        _train(out)
    assert json.loads((out / META_FILE).read_text())["status"] == "running"
    monkeypatch.setattr(runner, "export", real_export)
    _train(out, resume=True)
    a, b = (json.loads((d / META_FILE).read_text()) for d in (straight, out))
    assert a["steps"] == b["steps"] == 8 and b["heldout"]["stopped_at"] == 8
    assert [c["step"] for c in b["heldout"]["checks"]] == [2, 4, 6, 8]
    _same_weights(load_file(straight / "model.safetensors"), load_file(out / "model.safetensors"))


def test_a_run_that_never_reaches_the_target_finishes_at_max_steps(tmp_path, monkeypatch):
    steps = _scripted(monkeypatch, stop_at=99)
    out = _train(tmp_path / "run", overrides={"max_steps": 5})
    meta = json.loads((out / META_FILE).read_text())
    assert steps == [2, 4] and meta["status"] == "finished" and meta["steps"] == 5
    assert meta["heldout"]["stopped_at"] is None


def _same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


def test_a_task_without_enough_heldout_problems_is_one_line_before_anything_is_written(tmp_path):
    toy = {**FAST, "data": [{"source": "synthetic", "n": 50, "num_steps": 1}], "stop_at_heldout": {**STOP, "problems": 2000}}
    said = r"\(19 found\); lower stop_at_heldout.problems to 19 or fewer, or set stop_at_heldout: null"
    with pytest.raises(UserError, match=said):  # the count to lower to, from the split itself
        run_recipe("pretrain-tiny", "tiny-random-ouro", tmp_path / "run", overrides=toy, progress=False)
    assert not (tmp_path / "run" / "recipe.yaml").exists() and not (tmp_path / "run" / META_FILE).exists()
    # a run that ends before its first check draws no held-out problems (a short run of the recipe on another task)
    out = run_recipe("pretrain-tiny", "tiny-random-ouro", tmp_path / "short", progress=False,
                     overrides={**toy, "max_steps": 1})
    assert json.loads((out / META_FILE).read_text())["status"] == "finished"


# --- issue 69 item 1: a `problems` beyond the split is refused before the model loads, never drawn forever ---

TRAIN_ONE_STEP = ["train", "--recipe", "tiny-phase1", "--from", "tiny-random-ouro", "--max-steps", "1", "--no-progress"]


@pytest.mark.parametrize("problems, message", [
    (10**20, "more than a held-out split holds (at most 10000)"),  # drew forever: the hang of issue 69
    (24, "fewer than 24 problems beside its 100 test problems (23 found); lower stop_at_heldout.problems to 23"),
], ids=["absurd", "one-too-many"])
def test_problems_beyond_the_split_are_one_line_before_the_model_loads(tmp_path, capsys, monkeypatch, problems, message):
    from melt_eval.training import runner

    from helpers import main_exit_code, one_line_error

    def no_model(*args, **kwargs):
        raise AssertionError("the model was built before the held-out split was checked")

    monkeypatch.setattr(runner, "prepare_training", no_model)
    out = tmp_path / "run"
    spec = f"stop_at_heldout={{loops: 4, target: 0.5, every: 1, problems: {problems}}}"
    code = main_exit_code([*TRAIN_ONE_STEP, "--set", spec, "--output", out])
    one_line_error(capsys, code, message, "lower stop_at_heldout.problems")  # tiny-phase1's split holds 23
    assert not (out / "recipe.yaml").exists() and not (out / META_FILE).exists()
    assert not (out / ".melt-eval.lock").exists()  # the lock is released with the refusal


def test_a_synthetic_source_the_split_maker_refuses_is_one_line_not_a_traceback():
    """Only a split too small is told to lower its count; a source setting the split maker refuses (num_steps beyond
    the form's chain) is said as it is."""
    from melt_eval.errors import UserError
    from melt_eval.training.heldout import heldout_rows

    with pytest.raises(UserError, match=r"synthetic source, which is refused: num_steps must be within 1\.\.9"):
        heldout_rows({"source": "synthetic", "num_steps": 99}, 5)
