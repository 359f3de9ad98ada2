"""Exit-aware MELT training (recipe key exit_aware_p, docs/training.md#exit-aware-fine-tuning): the chunk-wise
forward leaves an exited token's shared entry at its exit loop exactly as the engine's `--exit` does, at full depth
it is today's forward, and the recipe's draw touches reply tokens only."""

import pytest
import torch

from helpers import main_exit_code, one_line_error
from melt_eval.errors import UserError
from melt_eval.modeling import early_exit
from melt_eval.modeling.kv_cache import StaticStore, policy_for
from melt_eval.modeling.melt import MeltForCausalLM
from melt_eval.training.config import load_recipe
from melt_eval.training.step import exit_loops, forward_objective

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT, REPLY = [1, 5, 7, 9, 11], [13, 21, 34, 8, 40, 17]
EXITS = [2, 4, 1, 3, 2, 4]  # the loop each reply token stops at (4 = T: full depth)


@pytest.fixture(scope="module")
def pair(random_looplm):
    teacher = random_looplm(0.3)
    return teacher, MeltForCausalLM.from_looplm(teacher).eval()


def _engine_logits(model, monkeypatch) -> list[torch.Tensor]:
    """The native engine's exit-loop logits for PROMPT (prefilled whole, full depth) then REPLY token by token,
    token j stopping after loop EXITS[j] (the decider forced)."""
    layout = model.cache_layout(share_prompt=False)
    keys, _ = layout.store_keys()
    store = StaticStore(keys, batch=1, kv_heads=layout.kv_heads, capacity=len(PROMPT) + len(REPLY),
                        head_dim=layout.head_dim, dtype=torch.float32, device="cpu")
    policy = policy_for(layout, store)
    with torch.no_grad():
        x, _ = model.model.run_chunk(torch.tensor([PROMPT]), torch.arange(len(PROMPT))[None], policy)
    logits = [model.lm_head(x[:, -1]).float()]
    depth = {}

    def stops(self, model, h):  # stop after loop depth["e"]
        self.loop = getattr(self, "loop", 0) + 1
        return torch.full((h.shape[0],), self.loop >= depth["e"]), None

    monkeypatch.setattr(early_exit._Decider, "stops", stops)
    for j, (token, e) in enumerate(zip(REPLY, EXITS)):
        depth["e"] = e
        out, used = early_exit.decode_step(model, torch.tensor([[token]]), torch.tensor([[len(PROMPT) + j]]), policy,
                                           ("gate", 0.5))
        assert used.tolist() == [e]
        logits.append(out)
    return logits


def test_a_trained_exit_leaves_what_the_engines_exit_leaves(pair, monkeypatch):
    """The training forward at chunk 1 (the prompt whole) with exit_loops: every token's exit-loop logits are the
    engine's, so each later token read the earlier tokens' entries as the engine left them; today's forward
    (every entry at loop T) gives other logits wherever an earlier token stopped early."""
    _, melt = pair
    engine = _engine_logits(melt, monkeypatch)
    ids, p, T = torch.tensor([PROMPT + REPLY]), len(PROMPT), 4
    exits = torch.tensor([[T] * p + EXITS])
    with torch.no_grad():
        trained = melt(ids, chunk_size=1, first_chunk=p, output_loop_states=True, exit_loops=exits)
        today = melt(ids, chunk_size=1, first_chunk=p, output_loop_states=True)
    torch.testing.assert_close(trained.loop_logits[T - 1][:, p - 1], engine[0])
    for j, e in enumerate(EXITS):
        torch.testing.assert_close(trained.loop_logits[e - 1][:, p + j], engine[j + 1])
    moved = (today.loop_logits[EXITS[1] - 1][:, p + 1] - engine[2]).abs().max()  # token 0 stopped at loop 2
    assert moved > 1e-2


def test_at_full_depth_the_forward_is_todays(pair, training_batch):
    _, melt = pair
    batch = training_batch(20, 16, (8, 10))
    ids = batch["input_ids"]
    with torch.no_grad():
        today = melt(ids, chunk_size=1, first_chunk=8, output_loop_states=True, compute_logits=False)
        full = melt(ids, chunk_size=1, first_chunk=8, output_loop_states=True, compute_logits=False,
                    exit_loops=torch.full_like(ids, 4))
    for a, b in zip(today.hidden_states, full.hidden_states):
        assert torch.equal(a, b)


def _recipe(**overrides):
    return load_recipe("tiny-exit-aware", overrides={"from_model": "x", **overrides})


def test_the_draw_stops_reply_tokens_only_and_repeats_on_resume(pair, training_batch):
    teacher, melt = pair
    batch = training_batch(24, 18, (10, 12))
    mask = batch["loss_mask"].bool()
    draw = exit_loops(_recipe(exit_aware_p=1.0), batch["loss_mask"], melt, (2, 7, 0))
    assert (draw[~mask] == 4).all() and set(draw[mask].tolist()) == {2, 3}
    half = exit_loops(_recipe(), batch["loss_mask"], melt, (2, 7, 0))
    assert torch.equal(half, exit_loops(_recipe(), batch["loss_mask"], melt, (2, 7, 0)))  # a resumed step draws the same
    assert not torch.equal(half, exit_loops(_recipe(), batch["loss_mask"], melt, (2, 8, 0)))
    assert 0 < (half[mask] < 4).float().mean() < 1
    assert exit_loops(_recipe(exit_aware_p=0.0), batch["loss_mask"], melt, (2, 7, 0)) is None
    every = exit_loops(_recipe(exit_aware_p=1.0, exit_aware_loops=[]), batch["loss_mask"], melt, (2, 7, 0))
    assert set(every[mask].tolist()) == {1, 2, 3}
    with pytest.raises(UserError, match="exit_aware_loops must be loops before the model's last"):
        exit_loops(_recipe(exit_aware_loops=[2, 4]), batch["loss_mask"], melt, (2, 7, 0))
    with pytest.raises(UserError, match="exit_aware_p needs a model with a shared cache"):
        exit_loops(_recipe(), batch["loss_mask"], teacher, (2, 7, 0))


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_the_objective_at_exit_probability_zero_is_todays(pair, training_batch, autocast):
    """p = 0 is the phase-2 objective of the same recipe without the key; p = 1 moves the loss, and its gradient
    reaches the model's weights and MELT's gates, in fp32 and under CPU bf16 autocast."""
    teacher, melt = pair
    batch = training_batch(24, 24, (10, 12))
    n = float(batch["loss_mask"][:, 1:].sum())
    phase2 = load_recipe("tiny-phase2", overrides={"from_model": "x"})
    kwargs = dict(n_loss_tokens=n, n_tokens=float(batch["attention_mask"].sum()))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        with torch.no_grad():
            today, _ = forward_objective(melt, teacher, batch, phase2, 3, **kwargs)
            zero, _ = forward_objective(melt, teacher, batch, _recipe(exit_aware_p=0.0, seed=phase2.seed), 3, **kwargs)
        melt.zero_grad(set_to_none=True)
        stopped, _ = forward_objective(melt, teacher, batch, _recipe(exit_aware_p=1.0), 3, **kwargs)
    assert zero.total.item() == today.total.item()
    assert abs(stopped.total.item() - today.total.item()) > 1e-4
    stopped.total.backward()
    grads = {name: p.grad for name, p in melt.named_parameters() if p.grad is not None}
    assert any(".melt_gate." in name for name in grads) and "model.layers.0.self_attn.kv_proj.weight" in grads
    assert all(torch.isfinite(g).all() for g in grads.values())
    melt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("overrides,message", [
    ({"exit_aware_p": 1.5}, "exit_aware_p must be within [0, 1]"),
    ({"exit_aware_loops": [0, 2]}, "exit_aware_loops must be [] (every loop before the last) or whole loops >= 1"),
    ({"exit_aware_loops": "2"}, "exit_aware_loops"),
    ({"interpolation_steps": 10, "phase": 1}, "exit_aware_p trains MELT to read early-exited entries"),
])
def test_a_wrong_exit_aware_recipe_is_one_line(overrides, message):
    with pytest.raises(UserError, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")
                       .replace(")", r"\)")):
        _recipe(**overrides)


def test_the_cli_refuses_a_wrong_exit_probability_in_one_line(tmp_path, capsys):
    code = main_exit_code(["train", "--recipe", "tiny-exit-aware", "--from", "tiny-random-melt", "--output",
                           str(tmp_path / "out"), "--set", "exit_aware_p=-0.1", "--no-progress"])
    one_line_error(capsys, code, "exit_aware_p must be within [0, 1]")
    assert not (tmp_path / "out").exists()


def test_a_cache_that_is_not_shared_refuses_exit_loops(pair):
    teacher, _ = pair
    with pytest.raises(ValueError, match="exit_loops trains an early exit into a shared cache"):
        teacher(torch.tensor([PROMPT]), exit_loops=torch.full((1, len(PROMPT)), 2))


def test_the_gate_fit_can_read_its_labels_off_an_exited_cache(pair, training_batch):
    """target exit_gate with exit_aware_p: the labels come from the forward whose earlier reply tokens left their
    entries at the drawn loops (a different loss from the full-depth fit); at p = 0 it is today's fit."""
    _, melt = pair
    batch = training_batch(24, 24, (10, 12))
    n = float(batch["loss_mask"][:, 1:].sum())
    gate = load_recipe("tiny-exit-gate", overrides={"from_model": "x"})
    kwargs = dict(n_loss_tokens=n, n_tokens=n)
    with torch.no_grad():
        today, _ = forward_objective(melt, None, batch, gate, 0, **kwargs)
        zero, _ = forward_objective(melt, None, batch, load_recipe("tiny-exit-gate", overrides={
            "from_model": "x", "exit_aware_p": 0.0, "exit_aware_loops": [2]}), 0, **kwargs)
        exited, _ = forward_objective(melt, None, batch, load_recipe("tiny-exit-gate", overrides={
            "from_model": "x", "exit_aware_p": 1.0, "exit_aware_loops": [1]}), 0, **kwargs)
    assert zero.total.item() == today.total.item()
    assert abs(exited.total.item() - today.total.item()) > 1e-4


def test_ablate_exit_chains_exit_aware_training_and_a_gate_fit_on_a_melt_with_a_teacher():
    """The exit-aware rows: tiny-exit-aware from the MELT, tiny-exit-gate from its output, one chain shared by the
    rows; planned for a MELT run of the plan (it records its teacher), not for a LoopLM or a registry MELT."""
    from melt_eval.experiments.ablations import TrainRun, exit_plan
    from melt_eval.protocol.variants import EXIT_AWARE

    melt = TrainRun(2, "tiny-phase2", {}, "runs/phase1")
    plans = [p for p in exit_plan("tiny", melt, {"max_steps": 5}) if p.name.startswith(EXIT_AWARE)]
    assert [(p.name, p.eval_options["exit"]) for p in plans] == [
        ("exit-aware-full", None), ("exit-aware-0.7", "gate:0.7"), ("exit-aware-0.8", "gate:0.8"),
        ("exit-aware-0.9", "gate:0.9")]
    aware, gate = plans[0].train
    assert (aware.recipe, aware.start, aware.overrides) == ("tiny-exit-aware", melt, {"max_steps": 5})
    assert (gate.recipe, gate.start) == ("tiny-exit-gate", aware)
    assert {tuple(r.run_id for r in p.train) for p in plans} == {(aware.run_id, gate.run_id)}
    for model in ("tiny-random-ouro", "tiny-random-melt", TrainRun(0, "pretrain-tiny", {}, "tiny-random-ouro")):
        assert not [p for p in exit_plan("tiny", model) if p.name.startswith(EXIT_AWARE)]


def test_the_report_draws_the_exit_aware_rows_as_their_own_series(tmp_path):
    import json

    from melt_eval.report.results import load_results
    from melt_eval.report.tables import build_tables

    for name, ckpt, rule, mean in (("full", "/ckpt/melt", None, None), ("gate-0.7", "/ckpt/melt", "gate:0.7", 2.0),
                                   ("exit-aware-full", "/runs/gate-of-aware", None, None),
                                   ("exit-aware-0.7", "/runs/gate-of-aware", "gate:0.7", 2.1)):
        raw = {"model": name, "task": "synthetic", "finished": True, "model_path": ckpt,
               "settings": {"loops": 4, "kv_sharing": None, "samples": 2, **({"exit": rule} if rule else {})},
               "metrics": {"pass@1": {"value": 0.5, "stderr": 0.05}}}
        if rule:
            raw["loops_per_token"] = {"mean": mean, "histogram": {"1": 0, "2": 9, "3": 1, "4": 0}}
        path = tmp_path / "ablations" / "exit" / "melt-tiny" / name / "synthetic" / "results.json"
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps(raw))
    [table] = [t for t in build_tables(load_results(tmp_path)) if t.key == "exit"]
    assert [(r.stub[0], r.stub[2]) for r in table.rows] == [
        ("melt-tiny", "all loops"), ("melt-tiny", "gate:0.7"),
        ("melt-tiny (exit-aware, fitted gate)", "all loops"), ("melt-tiny (exit-aware, fitted gate)", "gate:0.7")]


@pytest.mark.parametrize("chunk", [1, 3])
def test_the_gradient_through_exited_entries_is_the_concatenating_references(random_looplm, training_batch, chunk):
    """Through the in-place store (its commits and prefix attention), the gradient of every loop's logits with
    tokens stopped at drawn loops equals that of the literal concatenate-and-mask forward (tests/reference_chunked.py)."""
    from reference_chunked import reference_forward

    melt = MeltForCausalLM.from_looplm(random_looplm(0.1, torch.float64)).to(torch.float64)
    batch = training_batch(12, 12, (4, 5))
    ids, attn = batch["input_ids"], batch["attention_mask"]
    exits = torch.randint(1, 5, ids.shape, generator=torch.Generator().manual_seed(1))
    weights = torch.randn(4, generator=torch.Generator().manual_seed(2), dtype=torch.float64)

    def backward(loop_logits):
        melt.zero_grad(set_to_none=True)
        sum(w * x.pow(2).mean() for w, x in zip(weights, loop_logits)).backward()
        return {n: p.grad.clone() for n, p in melt.named_parameters() if p.grad is not None}

    ours = backward(melt(ids, chunk_size=chunk, first_chunk=4, output_loop_states=True, exit_loops=exits).loop_logits)
    theirs = backward(reference_forward(melt, ids, attn, chunk, first_chunk=4, exit_loops=exits)[0])
    today = backward(reference_forward(melt, ids, attn, chunk, first_chunk=4)[0])
    assert ours.keys() == theirs.keys()
    for name in ours:
        # RMSNorm computes in fp32 whatever the model's dtype: test_train_memory.py's tolerance
        torch.testing.assert_close(ours[name], theirs[name], atol=1e-6, rtol=0, msg=name)
    assert max(float((ours[n] - today[n]).abs().max()) for n in ours) > 1e-4  # the exits do change the gradient
