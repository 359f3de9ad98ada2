"""The exit-gate recipe (docs/training.md#fitting-the-exit-gate): only Ouro's early-exit gate trains, by Ouro's
stage-II objective on the model's own loop states (MELT's chunk-wise ones for MELT), and `ablate exit` plans one fit
per model for its fitted-gate rows."""

import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file

from helpers import main_exit_code, one_line_error
from melt_eval.files import write_sums
from melt_eval.generation.options import checkpoint_prefill_chunk
from melt_eval.modeling import LoopLMForCausalLM, MeltForCausalLM, load_model
from melt_eval.modeling.early_exit import exit_logit
from melt_eval.training import run_recipe
from melt_eval.synthetic import make_split, to_messages as synthetic_messages
from melt_eval.training.config import load_recipe
from melt_eval.training.data import encode_chat
from melt_eval.training.losses import exit_gate_labels, exit_gate_loss, exit_gate_objective
from melt_eval.training.step import forward_objective

pytestmark = pytest.mark.usefixtures("one_thread")

GATE = ("model.early_exit_gate.weight", "model.early_exit_gate.bias")
# tiny-exit-gate shrunk to seconds: 2 micro-batches of 4 sequences per step
FAST = {"seq_len": 64, "micro_batch_size": 4, "batch_tokens": 512, "warmup_steps": 1, "save_every": 0,
        "data": [{"source": "synthetic", "n": 100, "num_steps": 1}], "tensorboard": False}


@pytest.fixture
def fresh_accelerate_state():
    """Accelerate keeps its mixed-precision choice per process (as in test_mixed_precision.py)."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.mark.parametrize("kind, precision", [("ouro", "no"), ("melt", "bf16")])
def test_only_the_gate_changes_and_the_checkpoint_stays_what_it_was(tiny_dirs, tmp_path, kind, precision,
                                                                    fresh_accelerate_state):
    """Every tensor but the gate's is byte-identical; the output loads as the same kind, its record says the gate
    was fitted, and `run` chooses the same prompt chunk for it as for the checkpoint it came from."""
    src = tmp_path / "src"
    shutil.copytree(tiny_dirs[f"tiny-random-{kind}"], src)
    trained_with = {"target": "melt", "chunk_size": 1, "prompt_as_one_chunk": True, "seq_len": 112}
    (src / "melt_eval_training.json").write_text(json.dumps({"status": "finished", "recipe": trained_with,
                                                             "teacher": "the-teacher"}))
    # as `train` exports one: with its SHA256SUMS (a directory with a training record and no sums is refused)
    write_sums(src, [p.name for p in src.iterdir() if p.is_file() and p.name != "melt_eval_training.json"])
    out = run_recipe("tiny-exit-gate", str(src), tmp_path / "out", progress=False,
                     overrides={**FAST, "max_steps": 3, "mixed_precision": precision})
    before, after = load_file(src / "model.safetensors"), load_file(out / "model.safetensors")
    assert before.keys() == after.keys()
    same = [k for k in before if k not in GATE]
    assert all(torch.equal(before[k], after[k]) and before[k].dtype == after[k].dtype for k in same)
    assert not torch.equal(before[GATE[0]], after[GATE[0]])
    model, _ = load_model(str(out))
    assert isinstance(model, MeltForCausalLM if kind == "melt" else LoopLMForCausalLM)
    meta = json.loads((out / "melt_eval_training.json").read_text())
    assert meta["status"] == "finished" and meta["exit_gate"] == "fitted" and meta["target"] == "exit_gate"
    assert meta["model_recipe"] == trained_with and meta["teacher"] == "the-teacher"
    assert checkpoint_prefill_chunk(out)[0] == checkpoint_prefill_chunk(src)[0] == 112


def test_the_loss_is_ouro_stage_two_by_hand():
    """Labels from known per-loop losses: loop t's label is the gain of loop t + 1; the last loop has none."""
    losses = torch.tensor([[2.0, 1.0, 0.3], [1.0, 0.999, 0.3], [0.5, 1.5, 0.29]])  # [T = 3 loops, 3 tokens]
    w = exit_gate_labels(losses, k=50.0, gamma=0.005)
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    gains = [[1.0, 0.001, 0.0], [0.5, 0.0, 0.01]]  # max(0, L_t - L_{t+1}) for t = 1, 2
    expected = [[sig(50 * (g - 0.005)) for g in row] for row in gains]
    assert torch.allclose(w, torch.tensor(expected), atol=1e-6)
    logits = torch.tensor([[0.3, -1.0, 2.0], [-0.5, 0.0, 1.0]])
    by_hand = 0.0
    for j in range(3):  # tokens summed, loops averaged
        by_hand += sum(-(expected[t][j] * math.log(1 - sig(logits[t, j])) + (1 - expected[t][j]) * math.log(sig(logits[t, j])))
                       for t in range(2)) / 2
    assert exit_gate_loss(logits, w).item() == pytest.approx(by_hand, rel=1e-5)


def test_the_loop_losses_behind_the_labels_stay_fp32_under_bf16_autocast():
    """gamma = 0.005 nats is finer than bf16 logits resolve: the per-token losses are the fp32 ones under autocast."""
    from melt_eval.training.losses import per_token_cross_entropy

    torch.manual_seed(0)
    head, hidden, targets = torch.nn.Linear(64, 500, bias=False), torch.randn(30, 64), torch.randint(0, 500, (30,))
    plain = per_token_cross_entropy(head, hidden, targets)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast = per_token_cross_entropy(head, hidden, targets)
    assert autocast.dtype == torch.float32 and torch.allclose(plain, autocast, atol=1e-6)
    assert torch.allclose(plain, torch.nn.functional.cross_entropy(head(hidden), targets, reduction="none"), atol=1e-5)


def test_the_objective_reads_reply_tokens_only_and_reaches_only_the_gate(random_looplm, training_batch):
    """Divided by the step's loss tokens; a prompt token's state changes nothing; no gradient but the gate's."""
    model = random_looplm(0.2)
    batch = training_batch(24, 18, (10, 12))
    out = model(batch["input_ids"], output_loop_states=True, compute_logits=False)
    kwargs = dict(head=model.lm_head, gate_logit=lambda h: exit_logit(model, h), k=50.0, gamma=0.005)
    n = float(batch["loss_mask"][:, 1:].sum())
    terms = exit_gate_objective(out, batch["input_ids"], batch["loss_mask"], n_loss_tokens=n, **kwargs)
    out.hidden_states = [h.clone() for h in out.hidden_states]
    for h in out.hidden_states:
        h[0, :5] += 3.0  # prompt positions of row 0 (its loss starts at 10)
    moved = exit_gate_objective(out, batch["input_ids"], batch["loss_mask"], n_loss_tokens=2 * n, **kwargs)
    assert moved.total.item() == pytest.approx(terms.total.item() / 2, rel=1e-5)
    model.zero_grad(set_to_none=True)
    terms.total.backward()
    grads = {name for name, p in model.named_parameters() if p.grad is not None}
    assert grads == {"model.early_exit_gate.weight", "model.early_exit_gate.bias"}


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_melt_is_fitted_on_its_own_chunkwise_states(random_looplm, training_batch, autocast):
    """The recipe's forward on a MELT model is MELT's chunk-wise one (chunk 1, the prompt whole): its loss equals
    the objective on MELT's own loop states and differs from the LoopLM's on the same weights."""
    looplm = random_looplm(0.2)
    melt = MeltForCausalLM.from_looplm(looplm, gate="elementwise").eval()
    recipe = load_recipe("tiny-exit-gate", overrides={"from_model": "x"})
    batch = training_batch(24, 24, (10, 12))  # no padding: prompt_as_one_chunk takes the shortest prompt
    n = float(batch["loss_mask"][:, 1:].sum())
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        terms, _ = forward_objective(melt, None, batch, recipe, 0, n_loss_tokens=n, n_tokens=n)
        kwargs = dict(k=50.0, gamma=0.005, n_loss_tokens=n)
        own = melt(batch["input_ids"], chunk_size=1, first_chunk=10, output_loop_states=True, compute_logits=False)
        expected = exit_gate_objective(own, batch["input_ids"], batch["loss_mask"], head=melt.lm_head,
                                       gate_logit=lambda h: exit_logit(melt, h), **kwargs)
        ouro = looplm(batch["input_ids"], output_loop_states=True, compute_logits=False)
        other = exit_gate_objective(ouro, batch["input_ids"], batch["loss_mask"], head=looplm.lm_head,
                                    gate_logit=lambda h: exit_logit(looplm, h), **kwargs)
    assert terms.total.item() == pytest.approx(expected.total.item(), rel=1e-4)
    assert abs(terms.total.item() - other.total.item()) > 1e-3
    assert torch.isfinite(terms.total)


def test_the_gate_learns_to_exit_where_later_loops_do_not_help(tiny_dirs, tmp_path):
    """A LoopLM whose layers add nothing (o_proj and down_proj zero): every loop predicts as loop 1 does, so
    every label says exit (1 - w = 1 - sigmoid(-k gamma) = 0.56). A gate started near 'continue' (lambda ~ 0.05)
    rises toward it, and stops short of always exiting."""
    model, tok = load_model("tiny-random-ouro")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.early_exit_gate.bias.fill_(-3.0)
    src = tmp_path / "flat"
    model.save_pretrained(src)
    tok.save_pretrained(src)
    out = run_recipe("tiny-exit-gate", str(src), tmp_path / "out", progress=False,
                     overrides={**FAST, "max_steps": 30, "lr": 0.05})
    # lambda at loop 1 where a reply like the training ones (FAST: the boxed answer) is predicted; in this model a
    # state is its token's normed embedding, so the fit is judged on the tokens it was fitted on
    item = make_split("train", 1, num_steps=1)[0]
    ids, reply = encode_chat(tok, synthetic_messages(item), None)
    ids, reply = torch.tensor([ids]), torch.tensor(reply)
    fitted, _ = load_model(str(out))
    before, after = (m.early_exit_probabilities(ids)[0, 0, :-1][reply[1:]].mean() for m in (model, fitted))
    assert before < 0.1 and 0.4 < after < 0.75, (before, after)


def test_a_model_without_loops_is_one_line_exit_2(tiny_dirs, tmp_path, capsys):
    code = main_exit_code(["train", "--recipe", "tiny-exit-gate", "--from", tiny_dirs["tiny-random-llama"],
                           "--output", tmp_path / "out", "--no-progress"])
    one_line_error(capsys, code, "exit_gate", "looped model", "'llama'")
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_a_recipe_that_would_train_the_model_too_is_refused():
    from melt_eval.errors import UserError

    with pytest.raises(UserError, match="target exit_gate fits only the exit gate"):
        load_recipe("tiny-exit-gate", overrides={"kd": True})


def test_ablate_exit_fits_one_gate_per_model_for_its_fitted_rows():
    from melt_eval.experiments.ablations import exit_plan

    plans = exit_plan("tiny", train_overrides={"max_steps": 5})
    fitted = [p for p in plans if p.name.startswith("fitted-gate-")]
    assert {p.name for p in fitted} == {"fitted-gate-0.5", "fitted-gate-0.7", "fitted-gate-0.9", "fitted-gate-0.95",
                                        "fitted-gate-0.99"}
    for model in ("tiny-random-ouro", "tiny-random-melt"):
        runs = [p.train for p in fitted if p.ablation == f"exit/{model}"]
        assert len(runs) == 5 and all(len(r) == 1 for r in runs)
        assert {r[0].run_id for r in runs} == {runs[0][0].run_id}  # one fit, shared by every threshold
        assert runs[0][0].recipe == "tiny-exit-gate" and runs[0][0].start == model
        assert runs[0][0].overrides == {"max_steps": 5}
    inherited = [p for p in plans if p.name.startswith("gate-")]
    assert inherited and all(not p.train and p.base in ("tiny-random-ouro", "tiny-random-melt") for p in inherited)


def test_the_report_draws_the_fitted_gate_as_its_own_series(tmp_path):
    """`ablate exit`'s fitted-gate rows (another checkpoint: the fit) are their own rows and line, not merged
    into the checkpoint's own gate's."""
    from melt_eval.report.results import load_results
    from melt_eval.report.tables import build_tables
    from melt_eval.report.write import write_report

    def result(name, model_path, rule, pass1, mean):
        settings = {"loops": 4, "kv_sharing": None, "samples": 2, **({"exit": rule} if rule else {})}
        raw = {"model": name, "task": "synthetic", "finished": True, "settings": settings, "model_path": model_path,
               "metrics": {"pass@1": {"value": pass1, "stderr": 0.05}}}
        if rule:
            raw["loops_per_token"] = {"mean": mean, "histogram": {"1": 1, "2": 1, "3": 0, "4": 0}}
        path = tmp_path / "ablations" / "exit" / "tiny-random-melt" / name / "synthetic" / "results.json"
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps(raw))

    result("full", "/ckpt/melt", None, 0.6, None)
    result("gate-0.5", "/ckpt/melt", "gate:0.5", 0.3, 1.2)
    result("fitted-gate-0.5", "/runs/tiny-exit-gate-abc", "gate:0.5", 0.55, 2.5)
    [table] = [t for t in build_tables(load_results(tmp_path)) if t.key == "exit"]
    rows = [(r.stub[0], r.stub[2], r.cells[0].value) for r in table.rows]
    assert rows == [("tiny-random-melt", "all loops", 4.0), ("tiny-random-melt", "gate:0.5", 1.2),
                    ("tiny-random-melt (fitted gate)", "gate:0.5", 2.5)]
    out = write_report(tmp_path, tmp_path / "report", latex=False)
    assert tmp_path / "report" / "plots" / "exit.png" in out["files"]
