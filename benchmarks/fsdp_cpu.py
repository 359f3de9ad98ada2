"""FSDP2 (`fully_shard`) on 2 CPU ranks (gloo): which wrapping the looped forward allows, its collectives per
step, its gradients against one unsharded process, and the memory per rank it projects at the paper's shape.

    torchrun --standalone --nproc_per_node 2 benchmarks/fsdp_cpu.py            # prints one JSON object (rank 0)

The harness does not run this through Accelerate on CPUs: Accelerate 1.15 selects FSDP on accelerators only
(with cpu=True its state never takes the FSDP branch), so `melt-eval train` refuses an FSDP launch there
(training/launch.py: check_fsdp). This script calls torch's FSDP2 directly, on tiny-random-melt, to answer
what does not need a GPU: per-layer units against one unit for the whole model, given that the looped
forward calls each layer's pieces T times per chunk, not the layer's own forward.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from _args import Parser  # noqa: E402  (benchmarks/: the script's own folder)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

COLLECTIVES = ("all_gather_single", "reduce_scatter_single", "all_gather_into_tensor", "reduce_scatter_tensor")


def count_collectives() -> dict:
    """Wrap torch.distributed's collectives that FSDP2 calls; returns the live counts."""
    counts = {}
    for name in COLLECTIVES:
        if hasattr(dist, name):
            def wrapped(*args, _f=getattr(dist, name), _n=name, **kwargs):
                counts[_n] = counts.get(_n, 0) + 1
                return _f(*args, **kwargs)
            setattr(dist, name, wrapped)
    return counts


def loss_on(model, ids, n_global: int) -> torch.Tensor:
    """Next-token cross-entropy summed over this rank's rows, divided by the global token count (as training does)."""
    out = model(ids, attention_mask=torch.ones_like(ids, dtype=torch.bool), chunk_size=4, alpha=1.0)
    logits = out.logits[:, :-1].float()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                             reduction="sum") / n_global


def grad_norm(model) -> float:
    squares = 0.0
    for p in model.parameters():
        if p.grad is not None:
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            squares += float(g.double().pow(2).sum())
    return squares ** 0.5


def run(wrap: str, batch: torch.Tensor) -> dict:
    from torch.distributed.fsdp import fully_shard

    from melt_eval.modeling import load_model
    from melt_eval.modeling.loading import resolve_model_dir

    rank, world = dist.get_rank(), dist.get_world_size()
    model, _ = load_model(resolve_model_dir("tiny-random-melt"))
    model.model.early_exit_gate.requires_grad_(False)
    # the reference: one process, the whole batch
    reference = grad_norm_of(model, batch)
    if wrap == "per-layer":
        for layer in model.model.layers:
            fully_shard(layer, reshard_after_forward=False)
    fully_shard(model, reshard_after_forward=False)  # ZeRO-2, as melt_eval/recipes/accelerate/fsdp.yaml
    counts = count_collectives()
    rows = batch.shape[0] // world
    mine = batch[rank * rows:(rank + 1) * rows]
    try:
        # FSDP averages gradients over ranks: x world makes the sum of the per-rank sums
        (loss_on(model, mine, batch[:, 1:].numel()) * world).backward()
    except Exception as exc:  # noqa: BLE001 -- the failure is the finding
        return {"wrap": wrap, "runs": False, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
    sharded = grad_norm(model)
    return {"wrap": wrap, "runs": True, "collectives_per_forward_backward": dict(counts),
            "grad_norm": sharded, "grad_norm_one_process": reference,
            "relative_difference": abs(sharded - reference) / reference}


def grad_norm_of(model, batch: torch.Tensor) -> float:
    import copy

    ref = copy.deepcopy(model)
    loss_on(ref, batch, batch[:, 1:].numel()).backward()
    return grad_norm(ref)


def projection(params: float, ranks: int = 8) -> dict:
    """GB per rank at the paper's shape: fp32 weights (4 B), gradients (4 B) and AdamW's two moments (8 B) per
    parameter. One FSDP unit for the whole model gathers every weight for the whole looped step, so sharding the
    weights too (FULL_SHARD) saves nothing at the peak: SHARD_GRAD_OP shards gradients and AdamW only."""
    gb = 1e9
    one = {"weights": 4 * params / gb, "gradients": 4 * params / gb, "adamw": 8 * params / gb}
    shard = {"weights": one["weights"], "gradients": one["gradients"] / ranks, "adamw": one["adamw"] / ranks}
    return {"parameters": params, "ranks": ranks, "one_process_gb": {**one, "total": sum(one.values())},
            "shard_grad_op_per_rank_gb": {**shard, "total": sum(shard.values())},
            "gradients_plus_adamw_ratio": (shard["gradients"] + shard["adamw"]) / (one["gradients"] + one["adamw"])}


def paper_params() -> int:
    """MELT-1.6B's parameter count: Ouro-1.4B's shape as MELT with elementwise gates, built on the meta device."""
    from melt_eval.modeling import LoopLMConfig, MeltForCausalLM
    from melt_eval.modeling.looplm import LoopLMForCausalLM

    config = LoopLMConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=24, num_attention_heads=16,
                          num_key_value_heads=16, head_dim=128, vocab_size=49152, total_ut_steps=4)
    with torch.device("meta"):
        melt = MeltForCausalLM.from_looplm(LoopLMForCausalLM(config), gate="elementwise", seed=0)
    return sum(p.numel() for p in melt.parameters())


ROWS = 4  # the batch, split evenly over the ranks


def main(argv=None) -> None:
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.parse_args(argv)  # no options: anything given is refused, not ignored
    world = os.environ.get("WORLD_SIZE")
    if world is None or "MASTER_ADDR" not in os.environ:  # gloo would fail on the missing rendezvous
        parser.error("run it under torchrun: torchrun --standalone --nproc_per_node 2 benchmarks/fsdp_cpu.py")
    if not world.isdigit() or int(world) < 1 or ROWS % int(world):
        parser.error(f"--nproc_per_node must divide the batch's {ROWS} rows (1, 2 or 4), got {world}")
    dist.init_process_group("gloo")
    if dist.get_rank() == 0:  # built once, before the other ranks read it (a fresh home has no tiny model yet)
        from melt_eval.modeling.loading import resolve_model_dir

        resolve_model_dir("tiny-random-melt")
    dist.barrier()
    torch.manual_seed(0)
    batch = torch.randint(0, 500, (ROWS, 32))
    results = [run(wrap, batch) for wrap in ("one-unit", "per-layer")]
    if dist.get_rank() == 0:
        print(json.dumps({"world_size": dist.get_world_size(), "torch": torch.__version__, "model": "tiny-random-melt",
                          "chunk_size": 4, "results": results, "paper_projection": projection(paper_params())},
                         indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
