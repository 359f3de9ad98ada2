"""A chunk-1 MELT training step: the in-place store against one compiled function per token.

The demo's MELT runs train with chunk 1 (exact MELT: each reply token runs its T loops before the next
one), and at the tiny size a step is thousands of small operations: the store path
(`TrainingKVBuffer`) pays Python, dispatch and autograd bookkeeping per (layer, loop) and per token.
`compile_token_step` (recipe `compile: true` at chunk 1, melt_eval/modeling/token_step.py) makes a
token's whole chunk one function and compiles it. This times, in one run and through the real
`MeltForCausalLM.forward`:

    store, eager                    the default
    store, layer steps compiled     compile_layer_step (recipe `compile: true` at chunk > 1)
    per-token function, eager       token_step.token_chunk uncompiled: what fusing alone changes
    per-token function, compiled    compile_token_step

after checking that every row gives the first row's loss and gradients.

    python benchmarks/chunk1_fused.py [--batch 16] [--seq-len 112] [--prompt 19] [--steps 3] [--interp] [--json]

Random weights and tokens, the element-wise gate, the tiny preset (the demo's shape), one thread; alpha = 1,
or 0.5 with --interp (phase 1's transition: base and MELT entries both computed).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_throughput import build  # noqa: E402

from melt_eval.modeling.token_step import token_chunk  # noqa: E402


def step(model, ids, prompt: int, alpha: float) -> tuple[float, float]:
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    hidden = model(ids, chunk_size=1, first_chunk=prompt, alpha=alpha, compute_logits=False).last_hidden_state
    logits = model.lm_head(hidden[:, prompt - 1 : -1])  # predictions of the reply tokens
    loss = F.cross_entropy(logits.flatten(0, 1), ids[:, prompt:].flatten())
    loss.backward()
    return time.perf_counter() - t0, loss.item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=112)
    ap.add_argument("--prompt", type=int, default=19)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per row (best is reported), after one warm-up")
    ap.add_argument("--interp", action="store_true", help="alpha 0.5 (phase 1's transition) instead of 1")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    _, base = build("tiny", "cpu", torch.float32)
    base.train()
    ids = torch.randint(0, base.config.vocab_size, (args.batch, args.seq_len), generator=torch.Generator().manual_seed(0))
    P, alpha = args.prompt, 0.5 if args.interp else 1.0

    def variant(setup):
        model = copy.deepcopy(base)
        setup(model.model)
        return model

    rows = {
        "store, eager": base,
        "store, layer steps compiled": variant(lambda m: m.compile_layer_step()),
        "per-token function, eager": variant(lambda m: setattr(m, "token_step", token_chunk)),
        "per-token function, compiled": variant(lambda m: m.compile_token_step()),
    }
    first, grads = {}, {}
    for name, model in rows.items():  # the warm-up step compiles; it also gives the loss and gradients to check
        first[name], loss = step(model, ids, P, alpha)
        grads[name] = (loss, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    ref_loss, ref = grads["store, eager"]
    checks = {}
    for name, (loss, g) in grads.items():
        worst = max((g[n] - ref[n]).abs().max().item() / (ref[n].abs().max().item() or 1) for n in ref)
        checks[name] = {"loss_diff": abs(loss - ref_loss), "max_rel_grad_diff": worst}
        if abs(loss - ref_loss) > 1e-5 * abs(ref_loss) or worst > 1e-4 or set(g) != set(ref):
            sys.exit(f"error: {name} does not compute the store path's step ({checks[name]}); timings not comparable")

    load_start = os.getloadavg()
    times = {name: min(step(model, ids, P, alpha)[0] for _ in range(args.steps)) for name, model in rows.items()}
    report = {
        "machine": f"{platform.machine()} CPU, {os.cpu_count()} cores, one torch thread",
        "shape": {"batch": args.batch, "seq_len": args.seq_len, "prompt": P, "chunks": 1 + args.seq_len - P, "alpha": alpha},
        "load_average": {"start": load_start, "end": os.getloadavg()},
        "step_s": times, "vs_store_eager": {k: v / times["store, eager"] for k, v in times.items()},
        "first_step_s": first,  # a compiled row's includes its compilation
        "checks": checks,
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"chunk-1 MELT training step, tiny, B={args.batch}, L={args.seq_len} (prompt {P} as one chunk), alpha {alpha}, "
          f"{report['machine']}, load {load_start[0]:.2f} -> {report['load_average']['end'][0]:.2f}")
    print(f"{'forward':30} {'step s':>8} {'vs store':>9} {'first step s':>13} {'max rel grad diff':>18}")
    for name, t in times.items():
        print(f"{name:30} {t:8.3f} {report['vs_store_eager'][name]:8.2f}x {first[name]:13.1f} "
              f"{checks[name]['max_rel_grad_diff']:18.1e}")


if __name__ == "__main__":
    main()
