"""The training objective (docs/method.md#losses), alpha, the LR schedule, and the ablation ladder."""

import copy

import pytest
import torch

from melt_eval.errors import UserError
from melt_eval.modeling import MeltForCausalLM
from melt_eval.protocol.variants import GATE_VARIANTS, LADDER, training_steps
from melt_eval.training import load_recipe
from melt_eval.training.losses import align_loss, generalized_jsd, kd_loss, sft_loss
from melt_eval.training.runner import forward_objective, lr_factor, param_groups


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def looplm(random_looplm):
    return random_looplm(0.08, num_hidden_layers=2)  # MELT and the LoopLM really differ


@pytest.fixture(scope="module")
def batch(training_batch):
    return training_batch(20, pad_from=15, loss_from=(8, 10))


def counts(batch):
    return dict(n_loss_tokens=float(batch["loss_mask"][:, 1:].sum()), n_tokens=float(batch["attention_mask"].sum()))


def tiny(variant_overrides=None, **kw):
    return load_recipe("tiny-phase1", overrides={**(variant_overrides or {}), **kw})


# --- loss functions ----------------------------------------------------------------------------


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
def test_divergence_is_zero_only_when_distributions_agree(beta):
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(7, 50, generator=g), torch.randn(7, 50, generator=g)
    assert generalized_jsd(a, a.clone(), beta).abs().max() < 1e-6
    assert (generalized_jsd(a, b, beta) > 1e-3).all()


def test_forward_kl_and_jsd_match_their_definitions():
    g = torch.Generator().manual_seed(1)
    s, t = torch.randn(5, 30, generator=g), torch.randn(5, 30, generator=g)
    ps, pt = s.softmax(-1), t.softmax(-1)
    kl = lambda p, q: (p * (p / q).log()).sum(-1)  # noqa: E731
    assert torch.allclose(generalized_jsd(s, t, 0.0), kl(pt, ps), atol=1e-5)
    assert torch.allclose(generalized_jsd(s, t, 1.0), kl(ps, pt), atol=1e-5)
    m = 0.5 * pt + 0.5 * ps
    assert torch.allclose(generalized_jsd(s, t, 0.5), 0.5 * kl(pt, m) + 0.5 * kl(ps, m), atol=1e-5)


def test_sft_and_kd_count_only_response_tokens(batch):
    V = 40
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 20, V, generator=g)
    ids = batch["input_ids"] % V
    base = sft_loss(logits, ids, batch["loss_mask"])
    junk = logits.clone()
    junk[0, :7] += 100 * torch.randn(7, V, generator=g)  # positions predicting prompt tokens (targets 1..7)
    assert torch.allclose(sft_loss(junk, ids, batch["loss_mask"]), base)
    t = [torch.randn(2, 20, V, generator=g) for _ in range(3)]
    assert torch.allclose(kd_loss([logits] * 3, t, batch["loss_mask"]), kd_loss([junk] * 3, t, batch["loss_mask"]))
    # hand-computed: mean over loops of summed forward KL at the masked positions
    mask = batch["loss_mask"][:, 1:]
    want = sum(generalized_jsd(logits[:, :-1][mask], tt[:, :-1][mask]).sum() for tt in t) / 3
    assert torch.allclose(kd_loss([logits] * 3, t, batch["loss_mask"]), want)


def test_align_loss_is_mean_over_layers_and_loops_with_stop_gradient(batch):
    g = torch.Generator().manual_seed(3)
    s = [[torch.randn(2, 20, 8, generator=g, requires_grad=True) for _ in range(4)] for _ in range(2)]
    t = [[torch.randn(2, 20, 8, generator=g, requires_grad=True) for _ in range(4)] for _ in range(2)]
    mask = batch["attention_mask"]
    loss = align_loss(s, t, mask)
    want = sum(((a - b)[mask] ** 2).sum() for sl, tl in zip(s, t) for a, b in zip(sl, tl)) / 8
    assert torch.allclose(loss, want)
    loss.backward()
    assert s[0][0].grad is not None and t[0][0].grad is None  # sg(o_LoopLM)
    assert align_loss(s, [[x.detach() for x in l] for l in s], mask) == 0


# --- the objective on real models ------------------------------------------------------------------


def test_alpha0_training_loss_equals_the_looplm(looplm, batch):
    """At alpha = 0 MELT is exactly the LoopLM whatever the chunk size: same CE, zero KD."""
    student = MeltForCausalLM.from_looplm(looplm, gate="elementwise", seed=0)
    sft = tiny(kd=False, chunk_size=4)
    assert sft.alpha(0) == 0.0
    melt_terms, _ = forward_objective(student, None, batch, sft, 0, **counts(batch))
    last_loop_ce = load_recipe("pretrain-tiny", overrides={"loop_ce_weights": []})  # the final loop's CE, as MELT's SFT
    loop_terms, _ = forward_objective(looplm, None, batch, last_loop_ce, 0, **counts(batch))
    assert melt_terms.parts["sft"] == pytest.approx(loop_terms.parts["sft"], rel=1e-5)
    kd_terms, _ = forward_objective(student, looplm, batch, tiny(chunk_size=4), 0, **counts(batch))
    assert kd_terms.parts["kd"] < 1e-6
    # once alpha > 0 the student is MELT and KD is positive
    later, _ = forward_objective(student, looplm, batch, tiny(chunk_size=4), 60, **counts(batch))
    assert later.parts["kd"] > 1e-3


def test_prompt_as_one_chunk_trains_the_rule_of_a_whole_prompt_prefill(looplm, batch):
    """The micro-batch's shortest prompt (8 tokens: rows' replies start at 8 and 10) is one chunk, then chunks of C."""
    student = MeltForCausalLM.from_looplm(looplm, gate="elementwise", seed=0)
    recipe = tiny(kd=False, interpolation_steps=0, chunk_size=1, prompt_as_one_chunk=True)
    terms, _ = forward_objective(student, None, batch, recipe, 0, **counts(batch))
    with torch.no_grad():
        whole = sft_loss(student(batch["input_ids"], chunk_size=1, first_chunk=8).logits, batch["input_ids"], batch["loss_mask"])
        exact = sft_loss(student(batch["input_ids"], chunk_size=1).logits, batch["input_ids"], batch["loss_mask"])
    assert terms.parts["sft"] == pytest.approx(float(whole) / counts(batch)["n_loss_tokens"], rel=1e-5)
    assert abs(float(whole) - float(exact)) > 1e-3 * abs(float(exact))  # the prompt's chunk changes the loss
    with pytest.raises(UserError, match="prompt_as_one_chunk: false"):
        tiny(prompt_as_one_chunk=True, compile=True, chunk_size=16)
    assert tiny(prompt_as_one_chunk=True, compile=True, chunk_size=1).compile  # one compiled call per token


def test_loop_ce_weights_put_a_cross_entropy_on_every_loops_exit(looplm, batch):
    """A LoopLM trained as Ouro is: sum_t w_t CE_t over the loops' exits; [] keeps the final loop's alone."""
    last, _ = forward_objective(looplm, None, batch, load_recipe("pretrain-tiny", overrides={"loop_ce_weights": []}), 0, **counts(batch))
    only_last, _ = forward_objective(looplm, None, batch, load_recipe("pretrain-tiny", overrides={"loop_ce_weights": [0, 0, 0, 1]}), 0, **counts(batch))
    assert only_last.parts["sft"] == pytest.approx(last.parts["sft"], rel=1e-5)
    weights = [0.1, 0.2, 0.3, 0.4]
    terms, out = forward_objective(looplm, None, batch, load_recipe("pretrain-tiny", overrides={"loop_ce_weights": weights}), 0, **counts(batch))
    with torch.no_grad():
        per_loop = [float(sft_loss(looplm.lm_head(h), batch["input_ids"], batch["loss_mask"])) / counts(batch)["n_loss_tokens"]
                    for h in out.hidden_states]
    assert len(set(round(x, 3) for x in per_loop)) == 4  # the loops really predict differently
    assert terms.parts["sft"] == pytest.approx(sum(w * x for w, x in zip(weights, per_loop)), rel=1e-5)
    terms.total.backward()  # loop 1's exit is trained: the gradient reaches the first loop's input
    assert looplm.model.embed_tokens.weight.grad.abs().sum() > 0
    looplm.zero_grad(set_to_none=True)


@pytest.mark.parametrize("weights", [[0.5, 0.5], [0, 0, 0, 0], [1, -1, 1, 1], "all"])
def test_bad_loop_ce_weights_are_refused_with_the_fix(weights, tmp_path):
    from melt_eval.training import run_recipe

    with pytest.raises(UserError, match="loop_ce_weights"):
        recipe = load_recipe("pretrain-tiny", overrides={"loop_ce_weights": weights})
        # the count is checked against the model's T before the first step
        run_recipe(recipe, "tiny-random-ouro", tmp_path / "run", overrides={"max_steps": 1}, progress=False)
    assert not list((tmp_path / "run").glob("checkpoints/*"))


def test_kd_is_zero_when_student_is_teacher(looplm, batch):
    terms, _ = forward_objective(copy.deepcopy(looplm), looplm, batch,
                                 load_recipe("tiny-phase1", overrides={"interpolation_steps": 0, "align_beta": 0.1}), 0, **counts(batch))
    # a LoopLM student through the MELT objective: KD and alignment vanish
    assert terms.parts["kd"] < 1e-6 and terms.parts["align"] < 1e-8


def test_gradients_reach_gates_and_gate_lr_applies_only_to_them(looplm, batch):
    student = MeltForCausalLM.from_looplm(looplm, gate="elementwise", seed=0).train()
    recipe = tiny(lr=0.0, gate_lr=1e-2, weight_decay=0.0)
    terms, _ = forward_objective(student, looplm, batch, recipe, 30, **counts(batch))  # alpha 0.5
    terms.total.backward()
    gates = dict((n, p) for n, p in student.named_parameters() if ".melt_gate." in n)
    assert gates and all(p.grad is not None and p.grad.abs().sum() > 0 for p in gates.values())
    groups = param_groups(student, recipe)
    by_name = {g["name"]: g for g in groups}
    assert {id(p) for p in by_name["gate"]["params"]} == {id(p) for p in gates.values()}
    assert by_name["gate"]["lr"] == 1e-2 and by_name["base"]["lr"] == 0.0
    assert not ({id(p) for p in by_name["base"]["params"]} & {id(p) for p in gates.values()})
    before = {n: p.detach().clone() for n, p in student.named_parameters()}
    torch.optim.AdamW(groups, betas=(0.9, 0.95), weight_decay=0.0).step()
    changed = {n for n, p in student.named_parameters() if not torch.equal(p, before[n])}
    assert changed == set(gates)


# --- schedules and the ladder --------------------------------------------------------------------


def test_alpha_and_lr_schedules():
    r = tiny(interpolation_steps=10, warmup_steps=4, max_steps=20, min_lr_ratio=0.1)
    assert [r.alpha(s) for s in (0, 5, 10, 15)] == [0.0, 0.5, 1.0, 1.0]
    assert tiny(interpolation_steps=0).alpha(0) == 1.0
    f = [lr_factor(s, r) for s in range(20)]
    assert f[0] == pytest.approx(0.25) and f[3] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(f[3:], f[4:])) and f[-1] > 0.1


def test_a_longer_lr_schedule_stops_training_partway_down_its_cosine():
    """lr_schedule_steps: the learning rate of a run stopped at step 20 of a 40-step schedule is the 40-step
    run's at every step, not a cosine finished early; past the schedule it stays at the floor."""
    short = tiny(warmup_steps=4, max_steps=20, min_lr_ratio=0.1, lr_schedule_steps=40)
    full = tiny(warmup_steps=4, max_steps=40, min_lr_ratio=0.1)
    assert [lr_factor(s, short) for s in range(20)] == [lr_factor(s, full) for s in range(20)]
    assert lr_factor(19, short) > 0.5 > lr_factor(19, tiny(warmup_steps=4, max_steps=20, min_lr_ratio=0.1))
    assert lr_factor(60, tiny(warmup_steps=4, max_steps=80, min_lr_ratio=0.1, lr_schedule_steps=40)) == pytest.approx(0.1)
    with pytest.raises(UserError, match="lr_schedule_steps must be a whole number >= 1"):
        tiny(lr_schedule_steps=0)


@pytest.mark.parametrize("variant", list(LADDER))
def test_ladder_variant_builds_the_spec_objective(variant, looplm, batch):
    """Each component-removal row: which terms, which alpha at step 0, which chunk size, which phases."""
    steps = training_steps(variant, base="tiny")
    r1 = load_recipe(steps[0][1], overrides=steps[0][2])
    student = MeltForCausalLM.from_looplm(looplm, gate="elementwise", seed=0)
    terms, out = forward_objective(student, looplm, batch, r1, 0, **counts(batch))
    L = batch["input_ids"].shape[1]
    want = {
        #            terms in the loss, alpha at step 0, C, phase 2
        "full": ({"kd"}, 0.0, r1.chunk_size, True),
        "no-align": ({"kd"}, 0.0, r1.chunk_size, False),
        "no-interp": ({"kd"}, 1.0, r1.chunk_size, False),
        "no-kd": ({"sft"}, 1.0, r1.chunk_size, False),
        "no-chunk": ({"sft"}, 1.0, L, False),
    }[variant]
    trained = {k for k in terms.parts if k != "sft"} or {"sft"}
    assert trained == want[0] and r1.alpha(0) == want[1] and r1.chunk_size in (want[2], 0)
    assert (len(steps) == 2) == want[3]
    # the forward really used that chunk size and alpha: compare with an explicit call
    first = 8 if r1.prompt_as_one_chunk and r1.chunk_size else 0  # the batch's shortest prompt, as one chunk
    ref = student(batch["input_ids"], attention_mask=batch["attention_mask"], chunk_size=want[2], first_chunk=first,
                  alpha=want[1])
    assert torch.allclose(student.lm_head(out.last_hidden_state), ref.logits, atol=1e-5)
    if want[3]:
        r2 = load_recipe(steps[1][1], overrides=steps[1][2])
        terms2, _ = forward_objective(student, looplm, batch, r2, 0, **counts(batch))
        # the tiny recipe scales beta to the tiny model (see tiny-phase2.yaml); the paper's is 0.1
        assert set(terms2.parts) == {"kd", "align", "sft"} and r2.align_beta > 0 and r2.alpha(0) == 1.0
        assert load_recipe(training_steps(variant, base="paper")[1][1]).align_beta == 0.1
        assert terms2.total.item() == pytest.approx(terms2.parts["kd"] + r2.align_beta * terms2.parts["align"], rel=1e-5)


@pytest.mark.parametrize("variant", list(GATE_VARIANTS))
def test_gate_variants_are_phase1_runs_with_that_gate(variant):
    steps = training_steps(variant, base="paper")
    assert len(steps) == 1 and steps[0][0] == 1
    r = load_recipe(steps[0][1], overrides=steps[0][2])
    assert r.gate == {"ema-0.2": "ema"}.get(variant, variant) and r.phase == 1


def test_unknown_recipe_keys_are_rejected_with_the_valid_ones(tmp_path):
    with pytest.raises(UserError, match="unknown recipe key.*bogus.*valid keys: .*chunk_size"):
        load_recipe("tiny-phase1", overrides={"bogus": 1})
    bad = tmp_path / "r.yaml"
    bad.write_text("chunk_sise: 4\n")
    with pytest.raises(UserError, match="chunk_sise.*valid keys"):
        load_recipe("tiny-phase1", config_file=bad)
    with pytest.raises(UserError, match="unknown key.*bogus"):
        from melt_eval.training.data import build_source

        build_source({"source": "synthetic", "bogus": 1}, 0, 0)
    with pytest.raises(UserError, match="expects"):
        load_recipe("tiny-phase1", overrides={"chunk_size": "big"})


def test_paper_recipes_carry_the_paper_settings():
    p1, p2 = load_recipe("paper-phase1"), load_recipe("paper-phase2")
    for r in (p1, p2):
        assert (r.lr, r.gate_lr, r.weight_decay, r.grad_clip, r.adam_betas) == (8e-6, 5e-4, 1e-4, 1.0, [0.9, 0.95])
        assert (r.seq_len, r.batch_tokens, r.chunk_size, r.kd, r.kd_beta) == (10_000, 320_000, 500, True, 0.0)
        assert [d["path"] for d in r.data] == ["nvidia/AceReason-1.1-SFT", "open-thoughts/OpenThoughts3-1.2M"]
        assert [d["weight"] for d in r.data] == [0.5, 0.5]
    assert (p1.interpolation_steps, p1.max_steps * p1.batch_tokens, p1.align_beta) == (500, 160_000_000, 0.0)
    assert (p2.interpolation_steps, p2.max_steps * p2.batch_tokens, p2.align_beta) == (0, 96_000_000, 0.1)
    assert p1.grad_accum_steps(world_size=8) == 4
