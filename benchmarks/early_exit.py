"""Early exit in the native engine: decode wall time at a mean of 2 of 4 loops against full depth, one run.

    python benchmarks/early_exit.py [--preset tiny] [--batch 16] [--context 100] [--new 64] [--repeats 3] [--json]

Same weights, prompts and sampling for every variant, LoopLM (Ouro) and MELT:

    full depth            no --exit: today's decode step (`run_chunk`), all 4 loops
    exit step, 4 loops    the early-exit decode step with a rule no token meets before loop 4 (gate:0.99, CDF
                          1/2, 3/4, 7/8 < 0.99): its own overhead
    gate, all at loop 2   gate:0.7 with the exit gate set to lambda = 1/2 at every loop (CDF 1/2, 3/4, ...):
                          every generated token stops after loop 2
    agree:1, mixed        rows stop at different loops (random weights): the gathered path's cost when the
                          active rows change within a step; its mean loops are printed beside it

Only decode steps are timed (from the first sampled token to the last, through the engine's callback);
the prompt is prefilled at full depth in every variant. Random weights (the tiny preset: the registry's
tiny-random-ouro shape), one thread. Report the ratios from one run: absolute times depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _args import Parser, whole  # noqa: E402
from train_throughput import PRESETS, build  # noqa: E402

from melt_eval.generation import generate  # noqa: E402
from melt_eval.generation.options import InferenceOptions  # noqa: E402

VARIANTS = {"full depth": None, "exit step, 4 loops": "gate:0.99", "gate, all at loop 2": "gate:0.7",
            "agree:1, mixed": "agree:1"}


def decode_time(model, prompts, exit_rule, new: int) -> tuple[float, float]:
    """(seconds of decoding, mean loops per decoded token)."""
    stamps = []
    result = generate(model, prompts, InferenceOptions(prefill_chunk=len(prompts[0]), exit=exit_rule), n=1,
                      temperature=1.0, top_p=0.9, max_new_tokens=new, seed=0,
                      callback=lambda _: stamps.append(time.perf_counter()))
    if result.loop_counts is None:
        mean = float(model.config.total_ut_steps)
    else:
        counts = [sum(c) for c in zip(*(c for per in result.loop_counts for c in per))]
        mean = sum((d + 1) * n for d, n in enumerate(counts)) / sum(counts)
    return stamps[-1] - stamps[0], mean


def main() -> None:
    parser = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=list(PRESETS), default="tiny")
    parser.add_argument("--batch", type=whole(1), default=16, help="rows decoded together")
    parser.add_argument("--context", type=whole(1), default=100, help="prompt tokens")
    parser.add_argument("--new", type=whole(2), default=64, help="tokens generated per row (the first is the prefill's)")
    parser.add_argument("--repeats", type=whole(1), default=3, help="timed runs per variant (median), interleaved")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.context + args.new > 65536:
        parser.error("--context plus --new must fit the models' 65,536 positions")
    torch.set_num_threads(1)
    looplm, melt = build(args.preset, torch.device("cpu"), torch.float32)
    with torch.no_grad():  # lambda = sigmoid(0) = 1/2 whatever the state: the gate rule stops every token at loop 2
        for model in (looplm, melt):
            model.model.early_exit_gate.weight.zero_()
            model.model.early_exit_gate.bias.zero_()
    g = torch.Generator().manual_seed(0)
    vocab = looplm.config.vocab_size
    prompts = [torch.randint(0, vocab, (args.context,), generator=g).tolist() for _ in range(args.batch)]
    rows = []
    for name, model in (("looplm", looplm.eval()), ("melt", melt.eval())):
        times = {v: [] for v in VARIANTS}
        loops = {}
        decode_time(model, prompts, None, 4)  # warm-up
        for _ in range(args.repeats):  # interleaved, so a change in the machine's load hits every variant
            for variant, rule in VARIANTS.items():
                seconds, loops[variant] = decode_time(model, prompts, rule, args.new)
                times[variant].append(seconds)
        full = statistics.median(times["full depth"])
        for variant in VARIANTS:
            t = statistics.median(times[variant])
            rows.append({"model": name, "variant": variant, "mean_loops": loops[variant], "decode_s": t,
                         "vs_full_depth": t / full})
    info = {"preset": args.preset, "batch": args.batch, "context": args.context, "new": args.new,
            "repeats": args.repeats, "torch": torch.__version__, "cpu": platform.processor() or platform.machine()}
    if args.json:
        print(json.dumps({"settings": info, "rows": rows}, indent=1))
        return
    print(" ".join(f"{k}={v}" for k, v in info.items()))
    print(f"{'model':8} {'variant':22} {'mean loops':>10} {'decode s':>9} {'vs full':>8}")
    for r in rows:
        print(f"{r['model']:8} {r['variant']:22} {r['mean_loops']:10.2f} {r['decode_s']:9.3f} {r['vs_full_depth']:8.2f}")


if __name__ == "__main__":
    main()
