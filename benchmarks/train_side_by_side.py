"""Training runs side by side (`melt-eval demo --jobs`, `ablate --jobs`) against one after another.

The demo's MELT runs train a tiny model chunk by chunk (C = 1): each step is thousands of small
operations that a second torch thread barely speeds up. This trains the same independent runs (the
gate ablation's phase-1 runs, shortened) twice in one invocation: one after another in this process
with all of torch's threads, then `jobs` at a time in worker processes with one thread each, and
prints both wall times and their ratio (tests/test_ablate.py checks that both ways give the same weights).

    python benchmarks/train_side_by_side.py [--runs 2] [--jobs 2] [--steps 6] [--json]
"""

from __future__ import annotations

import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _args import Parser, whole  # noqa: E402

from melt_eval.experiments import ablations  # noqa: E402


def main(argv=None) -> dict:
    ap = Parser(description=__doc__.split("\n\n")[0])
    gates = len(ablations.plan("gates", "tiny"))
    ap.add_argument("--runs", type=whole(1, gates), default=2, help=f"independent phase-1 runs (gate variants, 1..{gates})")
    ap.add_argument("--jobs", type=whole(1, os.cpu_count() or 1), default=2, help="up to the cores")
    ap.add_argument("--steps", type=whole(1), default=6, help="optimiser steps per run (tiny-phase1 otherwise)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    import torch

    overrides = {"max_steps": args.steps, "save_every": args.steps, "tensorboard": False}
    runs = [v.train[0] for v in ablations.plan("gates", "tiny", train_overrides=overrides)][: args.runs]
    threads = torch.get_num_threads()
    load = [round(x, 2) for x in os.getloadavg()]
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        ablations.train_runs(runs, Path(tmp) / "sequential", jobs=1, progress=False)
        sequential = time.perf_counter() - t0
        t0 = time.perf_counter()
        ablations.train_runs(runs, Path(tmp) / "side", jobs=args.jobs, progress=False)
        side = time.perf_counter() - t0
    out = {"runs": len(runs), "steps": args.steps, "jobs": args.jobs, "threads_sequential": threads,
           "sequential_s": round(sequential, 1), "side_by_side_s": round(side, 1), "speedup": round(sequential / side, 2),
           "machine": f"{platform.machine()} CPU, {os.cpu_count()} cores",
           "load_average": {"start": load, "end": [round(x, 2) for x in os.getloadavg()]}}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"{out['runs']} tiny-phase1 runs of {args.steps} steps ({out['machine']}; load {load[0]} -> {out['load_average']['end'][0]}):")
        print(f"  one after another, {threads} threads: {out['sequential_s']} s")
        print(f"  {args.jobs} side by side, one thread each: {out['side_by_side_s']} s  ({out['speedup']}x)")
    return out


if __name__ == "__main__":
    main()
