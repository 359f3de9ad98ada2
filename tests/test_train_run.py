"""End-to-end `melt-eval train` on CPU: phase 1 -> phase 2, resume, faults, LoopLM pretraining."""

import json

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from melt_eval.cli import app
from melt_eval.errors import UserError
from melt_eval.generation import generate
from melt_eval.modeling import MeltForCausalLM, load_model
from melt_eval.modeling.tiny import build_tokenizer, make_tiny_looplm
from melt_eval.training import run_recipe
from melt_eval.training.runner import NonFiniteLoss

# tiny-phase1/2 shrunk to seconds: 2 micro-batches of 4 sequences per step (tests accumulation)
FAST = ["--set", "seq_len=64", "--set", "micro_batch_size=4", "--set", "batch_tokens=512", "--set", "warmup_steps=1",
        "--set", 'data=[{source: synthetic, n: 100, num_steps: 1}]', "--no-progress"]
FAST_OVERRIDES = {"seq_len": 64, "micro_batch_size": 4, "batch_tokens": 512, "warmup_steps": 1, "save_every": 2,
                  "data": [{"source": "synthetic", "n": 100, "num_steps": 1}], "tensorboard": False}


pytestmark = pytest.mark.usefixtures("one_thread")


def cli(*args):
    result = CliRunner().invoke(app, [str(a) for a in args])
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    assert result.exit_code == 0, result.output
    return result


def test_phase1_then_phase2_loads_and_generates(tmp_path):
    p1, p2 = tmp_path / "p1", tmp_path / "p2"
    cli("train", "--recipe", "tiny-phase1", "--from", "tiny-random-ouro", "--output", p1, "--max-steps", 3,
        "--interpolation-steps", 2, "--chunk-size", 8, *FAST)
    meta1 = json.loads((p1 / "melt_eval_training.json").read_text())
    assert meta1["status"] == "finished" and meta1["teacher"] == "tiny-random-ouro" and meta1["grad_accum_steps"] == 2
    assert meta1["code"]["git_sha"] and meta1["recipe"]["interpolation_steps"] == 2
    logs = [json.loads(l) for l in (p1 / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["alpha"] for r in logs] == [0.0, 0.5, 1.0]
    assert (logs[0]["loss"], logs[0]["grad_norm"]) == (0.0, 0.0)  # alpha = 0: the student is its teacher, no update
    first = logs[1]
    assert {"kd", "sft", "loss", "lr.base", "lr.gate", "tokens_per_s", "gate_mean", "grad_norm"} <= set(first)
    assert len(first["gate_mean"]) == 2 and first["gate_mean"]["layer0"][0] is None and 0 < first["gate_mean"]["layer0"][1] < 1
    assert list((p1 / "logs" / "tb").glob("events.*"))

    # phase 2 finds the teacher phase 1 recorded
    cli("train", "--recipe", "tiny-phase2", "--from", p1, "--output", p2, "--max-steps", 2, *FAST)
    meta2 = json.loads((p2 / "melt_eval_training.json").read_text())
    assert meta2["teacher"] == "tiny-random-ouro" and meta2["phase"] == 2
    logs2 = [json.loads(l) for l in (p2 / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["alpha"] == 1.0 and r["align"] > 0 and r["kd"] > 0 for r in logs2)

    model = MeltForCausalLM.from_pretrained(p2).eval()
    assert model.config.gate == "elementwise"
    loaded, tok = load_model(str(p2))
    assert isinstance(loaded, MeltForCausalLM)
    p1_weights, p2_weights = load_file(p1 / "model.safetensors"), load_file(p2 / "model.safetensors")
    assert not torch.equal(p1_weights["model.layers.0.mlp.up_proj.weight"], p2_weights["model.layers.0.mlp.up_proj.weight"])
    text = tok.apply_chat_template([{"role": "user", "content": "a = 3. b = a + 4. What is b?"}], tokenize=False, add_generation_prompt=True)
    prompt = tok(text, add_special_tokens=False)["input_ids"]
    res = generate(loaded, [prompt], max_new_tokens=5, temperature=1.0, seed=0)
    assert len(res.sequences[0][0]) >= 1


def test_resume_continues_at_the_same_step_and_data(tmp_path):
    common = dict(overrides={**FAST_OVERRIDES, "max_steps": 4, "interpolation_steps": 3}, progress=False)
    straight = run_recipe("tiny-phase1", "tiny-random-ouro", tmp_path / "a", **common)
    run_recipe("tiny-phase1", "tiny-random-ouro", tmp_path / "b", stop_after=2, **common)
    assert not (tmp_path / "b" / "model.safetensors").exists() and (tmp_path / "b" / "checkpoints" / "step-000002").is_dir()
    with pytest.raises(UserError, match="already holds a training run"):
        run_recipe("tiny-phase1", "tiny-random-ouro", tmp_path / "b", **common)
    with pytest.raises(UserError, match="recipe; these keys differ.*lr"):
        run_recipe("tiny-phase1", "tiny-random-ouro", tmp_path / "b", resume=True,
                   overrides={**common["overrides"], "lr": 1.0}, progress=False)
    resumed = run_recipe("tiny-phase1", "tiny-random-ouro", tmp_path / "b", resume=True, **common)
    a, b = load_file(straight / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    la = [json.loads(l) for l in (straight / "logs" / "metrics.jsonl").read_text().splitlines()]
    lb = [json.loads(l) for l in (resumed / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lb] == [1, 2, 3, 4]
    assert [r["loss"] for r in la] == pytest.approx([r["loss"] for r in lb], rel=1e-5)


def test_mismatched_teacher_is_refused_up_front(tmp_path):
    other = make_tiny_looplm(build_tokenizer(), num_hidden_layers=3)
    other.save_pretrained(tmp_path / "other")
    build_tokenizer().save_pretrained(tmp_path / "other")
    with pytest.raises(UserError, match="teacher does not match the student.*num_hidden_layers: student 2 vs teacher 3"):
        run_recipe("tiny-phase1", "tiny-random-ouro", tmp_path / "out", progress=False,
                   overrides={**FAST_OVERRIDES, "teacher": str(tmp_path / "other")})
    assert not (tmp_path / "out").exists()
    with pytest.raises(UserError, match="phase 2 continues a phase-1 MELT checkpoint"):
        run_recipe("tiny-phase2", "tiny-random-ouro", tmp_path / "out2", progress=False, overrides=FAST_OVERRIDES)


def test_nonfinite_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch):
    import melt_eval.training.step as step

    real = step.objective
    calls = {"n": 0}

    def poisoned(*args, **kwargs):
        terms = real(*args, **kwargs)
        calls["n"] += 1
        if calls["n"] > 4:  # steps 1-2 (two micro-batches each) are fine, step 3 is not
            terms.total = terms.total * float("nan")
        return terms

    monkeypatch.setattr(step, "objective", poisoned)
    out = tmp_path / "run"
    with pytest.raises(NonFiniteLoss, match=r"non-finite loss at step 3 .*last good checkpoint is .*step-000002"):
        # alpha 1 from the start: every step computes its objective (an alpha = 0 first step computes none)
        run_recipe("tiny-phase1", "tiny-random-ouro", out, progress=False,
                   overrides={**FAST_OVERRIDES, "max_steps": 5, "interpolation_steps": 0})
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-000002"]
    assert not (out / "model.safetensors").exists()
    w = load_file(out / "checkpoints" / "step-000002" / "state" / "model.safetensors")
    assert all(torch.isfinite(t).all() for t in w.values())


def test_pretrain_looplm_from_scratch(tmp_path):
    out = run_recipe("pretrain-tiny", "tiny-random-ouro", tmp_path / "pt", progress=False,
                     overrides={**FAST_OVERRIDES, "max_steps": 8, "lr": 3e-3, "model_overrides": {"total_ut_steps": 3},
                                "loop_ce_weights": [1 / 3] * 3})  # one exit weight per loop of the changed T
    logs = [json.loads(l) for l in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert logs[-1]["sft"] < logs[0]["sft"] - 0.5 and "kd" not in logs[0]
    model, _ = load_model(str(out))
    assert type(model).__name__ == "LoopLMForCausalLM" and model.config.total_ut_steps == 3
    meta = json.loads((out / "melt_eval_training.json").read_text())
    assert meta["target"] == "looplm" and meta["teacher"] is None


@pytest.mark.slow
def test_compiled_token_step_trains_the_demo_recipe_like_eager(tmp_path):
    """`compile: true` on the demo's recipe (chunk 1, the prompt as one chunk) compiles each token's whole
    chunk (compile_token_step): the same losses as eager, no padding added. At alpha 1 from the start: at
    alpha 0 the student is its teacher and its gradients are rounding noise, which AdamW turns into lr-sized
    steps (test_train_memory.py compares the compiled interpolation's gradients directly)."""
    common = {**FAST_OVERRIDES, "max_steps": 2, "interpolation_steps": 0}
    eager = run_recipe("tiny-phase1", "tiny-random-ouro", tmp_path / "eager", progress=False, overrides=common)
    compiled = run_recipe("tiny-phase1", "tiny-random-ouro", tmp_path / "compiled", progress=False,
                          overrides={**common, "compile": True})
    la = [json.loads(l) for l in (eager / "logs" / "metrics.jsonl").read_text().splitlines()]
    lb = [json.loads(l) for l in (compiled / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in lb] == pytest.approx([r["loss"] for r in la], rel=1e-4)
    assert [r["padding_fraction"] for r in lb] == [r["padding_fraction"] for r in la]


@pytest.mark.slow
@pytest.mark.parametrize("mode", [True, "captured"], ids=["layer-step", "captured"])
def test_compiled_layer_step_trains_like_eager_and_may_change_on_resume(tmp_path, mode):
    """`compile: true` pads rows to whole chunks and compiles the layer step (`compile: captured`: each (layer,
    loop) step whole): the same losses as eager; being an execution field, it may be switched off when resuming.
    (Weights are not compared: AdamW turns float-rounding differences in near-zero gradients into lr-sized steps.)"""
    common = {**FAST_OVERRIDES, "max_steps": 2, "interpolation_steps": 0, "chunk_size": 16,
              "prompt_as_one_chunk": False}  # compile pads to whole chunks from the first token
    eager = run_recipe("tiny-phase1", "tiny-random-ouro", tmp_path / "eager", progress=False, overrides=common)
    run_recipe("tiny-phase1", "tiny-random-ouro", tmp_path / "compiled", progress=False, stop_after=1,
               overrides={**common, "compile": mode, "save_every": 1})
    logged = json.loads((tmp_path / "compiled" / "logs" / "metrics.jsonl").read_text().splitlines()[0])
    resumed = run_recipe("tiny-phase1", "tiny-random-ouro", tmp_path / "compiled", progress=False, resume=True,
                         overrides={**common, "save_every": 1})
    la = [json.loads(l) for l in (eager / "logs" / "metrics.jsonl").read_text().splitlines()]
    lb = [json.loads(l) for l in (resumed / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert logged["loss"] == pytest.approx(la[0]["loss"], rel=1e-5)
    assert [r["loss"] for r in lb] == pytest.approx([r["loss"] for r in la], rel=1e-4)
    assert lb[0]["padding_fraction"] > la[0]["padding_fraction"]  # rows padded to whole chunks of 16


def test_a_relative_teacher_is_found_from_another_directory(tmp_path, monkeypatch):
    """A MELT converted from a relative checkpoint directory (the demo's default output is demo/) records its
    teacher absolute, so a run that continues it from another directory (phase 2, exit-aware training) finds it."""
    import shutil

    from melt_eval.modeling.loading import resolve_model_dir
    from melt_eval.training.build import recorded_teacher

    shutil.copytree(resolve_model_dir("tiny-random-ouro"), tmp_path / "demo" / "teacher")
    monkeypatch.chdir(tmp_path)
    cli("train", "--recipe", "tiny-phase1", "--from", "demo/teacher", "--output", "demo/melt", "--max-steps", 1, *FAST)
    monkeypatch.chdir(tmp_path / "demo")
    assert recorded_teacher(tmp_path / "demo" / "melt") == str(tmp_path / "demo" / "teacher")
    cli("train", "--recipe", "tiny-phase2", "--from", "melt", "--output", "melt2", "--max-steps", 1, *FAST)
    assert json.loads((tmp_path / "demo" / "melt2" / "melt_eval_training.json").read_text())["status"] == "finished"
