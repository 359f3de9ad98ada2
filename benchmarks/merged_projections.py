"""What merging the projections that share an input would save in a chunk-wise MELT training step.

Per (layer, loop) a MELT step projects three inputs (docs/method.md#shared-cache): a_t = input_layernorm(x)
to the query (and, at alpha < 1, to the base key and value), the state h_t to the shared key and
value, and the post-attention norm to the MLP's gate and up. Separate `nn.Linear`s run 5 matrix
products at alpha = 1 and 7 at alpha < 1; merged weights (q|k_base|v_base, k|v, gate|up) run 3.
This times the forward and backward of exactly those products both ways, in one run, at the shape
of one chunk (B sequences x C tokens), and scales the saving to a training step
(layers x loops x chunks layer-steps) beside a real step of the same shape timed in the same run.

    python benchmarks/merged_projections.py [--preset tiny] [--batch 16] [--seq-len 100]
        [--chunk 1] [--alpha 1|0.5] [--json]

The merged weights are concatenated once, outside the timed loop, as merged parameters would be.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_throughput import PRESETS, build, measure  # noqa: E402

from melt_eval.training.config import Recipe  # noqa: E402


def _time(fn, repeats: int) -> float:
    """Median seconds of `fn` over `repeats` runs of 20 calls each, after a warm-up."""
    for _ in range(5):
        fn()
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(20):
            fn()
        runs.append((time.perf_counter() - t0) / 20)
    return statistics.median(runs)


def projection_step(layer, rows: int, interp: bool, merged: bool, generator: torch.Generator):
    """A closure running one (layer, loop) step's projections forward and backward on `rows` tokens. The model
    stores k|v and gate|up merged (`LoopLMAttention.kv_proj`, `LoopLMMLP.gate_up_proj`); the separate form
    is their halves, as separate `nn.Linear`s held them before."""
    attn, mlp = layer.self_attn, layer.mlp
    q_w = attn.q_proj.weight.detach()
    k_w, v_w = attn.kv_proj.weight.detach().chunk(2)
    gate_w, up_w = mlp.gate_up_proj.weight.detach().chunk(2)
    d = q_w.shape[1]
    a, h, m = (torch.randn(rows, d, generator=generator, requires_grad=True) for _ in range(3))
    if merged:
        groups = [(a, [q_w, k_w, v_w] if interp else [q_w]), (h, [k_w, v_w]), (m, [gate_w, up_w])]
        weights = [(x, torch.cat(ws).requires_grad_()) for x, ws in groups]
    else:
        mods = [(a, q_w)] + ([(a, k_w), (a, v_w)] if interp else [])
        mods += [(h, k_w), (h, v_w), (m, gate_w), (m, up_w)]
        weights = [(x, w.clone().requires_grad_()) for x, w in mods]
    grads = [torch.randn(rows, w.shape[0], generator=generator) for _, w in weights]

    def step():
        outs = [F.linear(x, w) for x, w in weights]
        torch.autograd.backward(outs, grads)

    return step, len(weights)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=list(PRESETS), default="tiny")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=100)
    ap.add_argument("--chunk", type=int, default=1)
    ap.add_argument("--alpha", type=float, default=1.0, help="below 1: the base key and value are projected too")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    torch.manual_seed(0)
    interp = args.alpha < 1.0
    _, melt = build(args.preset, torch.device("cpu"), torch.float32)
    layer = melt.model.layers[0]
    g = torch.Generator().manual_seed(0)
    timings = {}
    for merged in (False, True):
        step, products = projection_step(layer, args.batch * args.chunk, interp, merged, g)
        timings[merged] = {"products": products, "s": _time(step, args.repeats)}

    cfg = melt.config
    n_chunks = -(-args.seq_len // args.chunk)
    layer_steps = cfg.num_hidden_layers * cfg.total_ut_steps * n_chunks
    ids = torch.randint(0, PRESETS[args.preset]["vocab_size"], (args.batch, args.seq_len), generator=g)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids, dtype=torch.bool),
             "loss_mask": torch.ones_like(ids, dtype=torch.bool)}
    recipe = Recipe(kd=False, chunk_size=args.chunk, interpolation_steps=2 if interp else 0,
                    data=[{"source": "synthetic"}])
    real = measure(melt, recipe, batch, steps=3, step_index=1 if interp else 0, device=torch.device("cpu"))

    saving_per_layer_step = timings[False]["s"] - timings[True]["s"]
    result = {"preset": args.preset, "batch": args.batch, "seq_len": args.seq_len, "chunk_size": args.chunk,
              "alpha": args.alpha, "threads": torch.get_num_threads(), "layer_steps_per_step": layer_steps,
              "separate_s": timings[False]["s"], "merged_s": timings[True]["s"],
              "separate_products": timings[False]["products"], "merged_products": timings[True]["products"],
              "training_step_s": real["step_s"],
              "projected_saving_per_step_s": saving_per_layer_step * layer_steps,
              "projected_saving_fraction": saving_per_layer_step * layer_steps / real["step_s"]}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"projections of one (layer, loop) step: {args.preset}, {args.batch} x {args.chunk} tokens, "
              f"alpha {args.alpha}, {result['threads']} threads")
        for name, merged in (("separate", False), ("merged", True)):
            t = timings[merged]
            print(f"  {name:<9} {t['products']} products  {t['s'] * 1e6:8.1f} us forward + backward")
        print(f"  merged / separate: {result['merged_s'] / result['separate_s']:.2f}x")
        print(f"training step ({layer_steps} layer-steps): {real['step_s']:.3f} s; merging would save about "
              f"{result['projected_saving_per_step_s']:.3f} s ({100 * result['projected_saving_fraction']:.1f}%)")
    return result


if __name__ == "__main__":
    main()
