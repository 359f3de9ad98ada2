"""AdamW as `melt-eval train` builds it (training.build.make_optimizer): fused or foreach, its state built when
the run starts, so a step allocates nothing (issue 49: an out-of-memory error inside `opt.step()` left a
parameter with `exp_avg` but no `exp_avg_sq`, and the next step raised KeyError)."""

import copy

import pytest
import torch

from melt_eval.modeling import MeltForCausalLM
from melt_eval.training import load_recipe
from melt_eval.training.build import allocate_optimizer_state, make_optimizer

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def model(random_looplm):
    looplm = random_looplm(0.1, num_hidden_layers=1, num_attention_heads=2, head_dim=16, hidden_size=32,
                           intermediate_size=48, loops=2)
    return MeltForCausalLM.from_looplm(looplm, gate="elementwise", seed=1).train()


def fill_grads(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g) if p.requires_grad else None


def test_the_state_is_whole_before_the_first_step_and_steps_as_adamw_would(model):
    recipe = load_recipe("tiny-phase1")
    opt = make_optimizer(model, recipe)
    assert all(g.get("fused") or g.get("foreach") for g in opt.param_groups)
    allocate_optimizer_state(opt)
    params = [p for g in opt.param_groups for p in g["params"]]
    assert params and all(set(opt.state[p]) >= {"step", "exp_avg", "exp_avg_sq"} for p in params)
    lazy_model = copy.deepcopy(model)
    lazy = make_optimizer(lazy_model, recipe)  # AdamW's own lazy initialisation, for comparison
    for step in range(2):
        for m, o in ((model, opt), (lazy_model, lazy)):
            fill_grads(m, step)
            o.step()
            o.zero_grad(set_to_none=True)
    for (name, got), want in zip(model.named_parameters(), lazy_model.parameters()):
        assert torch.equal(got, want), name


def test_a_step_allocates_nothing_so_running_out_of_memory_cannot_half_build_the_state(model, monkeypatch):
    opt = make_optimizer(model, load_recipe("tiny-phase1"))
    allocate_optimizer_state(opt)
    fill_grads(model, 0)

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("no memory left")

    monkeypatch.setattr(torch, "zeros_like", out_of_memory)  # what AdamW's lazy initialisation calls
    opt.step()
    monkeypatch.undo()
    assert all(int(opt.state[p]["step"]) == 1 for g in opt.param_groups for p in g["params"])
