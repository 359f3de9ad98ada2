"""`compile: captured`: each (layer, loop) step, attention included, is one compiled graph forward and one for its
recompute and backward (melt_eval/modeling/captured_step.py). It must give the eager step's loss and gradients,
break no graph, and compile nothing new at a later chunk or at another padded length."""

import copy
import json

import pytest
import torch
from torch._dynamo.utils import counters

from melt_eval.errors import UserError
from melt_eval.modeling import MeltForCausalLM
from melt_eval.training import load_recipe
from melt_eval.training.build import prepare_student
from melt_eval.training.runner import forward_objective

pytestmark = pytest.mark.usefixtures("one_thread")

L = 9  # whole chunks of 3, as training pads rows under compile


@pytest.fixture(scope="module")
def batches(training_batch):
    return training_batch(L, pad_from=7, loss_from=(4, 3)), training_batch(L + 3, pad_from=10, loss_from=(5, 3))


def recipe_at(alpha: float, C: int, align_beta: float, **overrides):
    interp, step = {0.3: (10, 3), 1.0: (0, 0)}[alpha]  # alpha(step) = step / interpolation_steps
    return load_recipe("tiny-phase1", overrides={"chunk_size": C, "interpolation_steps": interp, "align_beta": align_beta,
                                                 "prompt_as_one_chunk": False, **overrides}), step


def train_once(student, teacher, batch, recipe, step):
    n_loss, n_tok = float(batch["loss_mask"][:, 1:].sum()), float(batch["attention_mask"].sum())
    terms, out = forward_objective(student, teacher, batch, recipe, step, n_loss_tokens=n_loss, n_tokens=n_tok)
    terms.total.backward()
    grads = {n: p.grad.clone() for n, p in student.named_parameters() if p.grad is not None}
    student.zero_grad(set_to_none=True)
    return terms.total.item(), grads, out.gate_means


CASES = {  # (gate, alpha, C, align_beta, recipe overrides, MeltForCausalLM.from_looplm options)
    # phase 1 mid-transition: base and MELT entries, the mixed cache, the alignment loss (o's gradient)
    "melt-elementwise-phase1-C3": ("elementwise", 0.3, 3, 0.1, {}, {}),
    # MELT's shared cache at chunk 1, the rule it decodes with
    "melt-scalar-C1": ("scalar", 1.0, 1, 0.0, {}, {}),
    # a LoopLM's 2 key/value heads mean-pooled into 1 when converting (grouped-query MELT, recipe kv_heads)
    "melt-kv-heads-1-C3": ("elementwise", 1.0, 3, 0.1, {}, {"kv_heads": 1}),
    # exit-aware training: reply tokens leave their shared entries at drawn loops
    "melt-exit-aware-C3": ("elementwise", 1.0, 3, 0.0, {"exit_aware_p": 0.9, "exit_aware_loops": [1, 2]}, {}),
    # Ouro's per-loop cache: one chunk, the whole row
    "looplm": (None, 1.0, 3, 0.1, {}, {}),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_the_captured_step_gives_the_eager_gradients_without_a_graph_break(chunk_looplm, batches, case):
    gate, alpha, C, align_beta, overrides, conversion = CASES[case]
    recipe, step = recipe_at(alpha, C, align_beta, **overrides)
    batch, longer = batches

    def student():
        if gate is None:
            model = copy.deepcopy(chunk_looplm).train()
        else:
            model = MeltForCausalLM.from_looplm(chunk_looplm, gate=gate, seed=1, **conversion).train()
        model.model.early_exit_gate.requires_grad_(False)
        model.gradient_checkpointing_enable()
        return model

    eager = train_once(student(), chunk_looplm, batch, recipe, step)
    torch._dynamo.reset()  # other tests' graphs count toward the recompile limit
    captured_model = student()
    captured_model.model.compile_captured_step()
    breaks = sum(counters["graph_break"].values())
    graphs = counters["stats"]["unique_graphs"]
    captured = train_once(captured_model, chunk_looplm, batch, recipe, step)
    assert counters["stats"]["unique_graphs"] > graphs  # really compiled, not run eagerly
    assert sum(counters["graph_break"].values()) == breaks

    assert abs(captured[0] - eager[0]) < 1e-9
    assert set(captured[1]) == set(eager[1]) and len(eager[1]) > 10
    for name in eager[1]:
        torch.testing.assert_close(captured[1][name], eager[1][name], atol=1e-9, rtol=0, msg=name)
    if gate in ("elementwise", "scalar"):  # the gate statistics training logs, chunk means taken in fp32
        torch.testing.assert_close(captured[2], eager[2], atol=1e-6, rtol=0, equal_nan=True)

    # the same step again, and a batch 3 tokens longer: every chunk runs graphs compiled already (a MELT chunk
    # reads its key's store whole, its length a dynamic size; Ouro's one chunk is the row, so a new length is a
    # new shape there)
    graphs = counters["stats"]["unique_graphs"]
    again = train_once(captured_model, chunk_looplm, batch, recipe, step)
    assert again[0] == captured[0]
    if gate is not None:
        longer_eager = train_once(student(), chunk_looplm, longer, recipe, step)
        longer_captured = train_once(captured_model, chunk_looplm, longer, recipe, step)
        assert abs(longer_captured[0] - longer_eager[0]) < 1e-9
    assert counters["stats"]["unique_graphs"] == graphs
    assert sum(counters["graph_break"].values()) == breaks


def test_recipes_take_compile_captured_and_refuse_other_words():
    assert load_recipe("tiny-phase1", overrides={"compile": "captured", "prompt_as_one_chunk": False}).compile == "captured"
    assert load_recipe("tiny-phase1", overrides={"compile": "true", "prompt_as_one_chunk": False}).compile is True
    with pytest.raises(UserError, match="expects true, false or captured"):
        load_recipe("tiny-phase1", overrides={"compile": "graphs"})
    for wrong in (1, 0.0, ["captured"]):
        with pytest.raises(UserError, match="expects true, false or captured"):
            load_recipe("tiny-phase1", overrides={"compile": wrong})


def test_a_captured_step_is_refused_under_several_processes(chunk_looplm):
    """Its backward adds the weights' gradients into .grad itself, bypassing the accumulation DDP and FSDP hook."""
    recipe = load_recipe("tiny-phase1", overrides={"compile": "captured", "prompt_as_one_chunk": False})
    student = MeltForCausalLM.from_looplm(chunk_looplm, gate="elementwise", seed=1)
    with pytest.raises(UserError, match="set compile: true"):
        prepare_student(student, recipe, one_process=False)
    assert prepare_student(student, recipe, one_process=True) == recipe.chunk_size
    assert student.model.captured_step is not None


@pytest.mark.slow
def test_a_captured_phase_1_run_crosses_from_the_interpolated_cache_to_the_shared_one(tmp_path):
    """Phase 1 compiles every step kind twice, at alpha < 1 and at alpha = 1: with room for one set, dynamo's
    recompile limit (fatal under fullgraph) stopped the demo's `tiny-phase1` at step 31 (issue 68's measure).
    Two interpolation steps cross the same line in four steps."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "melt_eval.cli", "train", "--recipe", "tiny-phase1", "--from",
                           "tiny-random-ouro", "--max-steps", "4", "--set", "compile=captured", "--set",
                           "interpolation_steps=2", "--no-progress", "--output", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["alpha"] for r in rows] == [0.0, 0.5, 1.0, 1.0]
