"""How far the compiled training steps land from the eager one: `tiny-phase1` from tiny-random-ouro for `--steps`
optimiser steps (the demo's 80 by default) with `compile: false`, `true` and `captured`, each a `melt-eval train`
process on the pinned float path, then the largest absolute difference of any weight against eager's.

    python benchmarks/compiled_agreement.py [--steps 80] [--threads 1] [--out DIR] [--json FILE]

Compiled code fuses and reorders float operations, so it rounds differently; what this bounds is how much those
roundings grow over a run. docs/training.md quotes the figure it printed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from _args import Parser  # noqa: E402  (benchmarks/: the script's own folder)

MODES = ("false", "true", "captured")


def train(mode: str, steps: int, out: Path, threads: int) -> float:
    t0 = time.perf_counter()
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    subprocess.run([sys.executable, "-m", "melt_eval.cli", "train", "--recipe", "tiny-phase1", "--from", "tiny-random-ouro",
                    "--max-steps", str(steps), "--set", f"compile={mode}", "--set", "save_every=0", "--no-progress",
                    "--output", str(out)], check=True, stdout=subprocess.DEVNULL, env=env)
    return time.perf_counter() - t0


def largest_differences(a: Path, b: Path) -> dict:
    from safetensors.torch import load_file

    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    diff = {k: float((wa[k].double() - wb[k].double()).abs().max()) for k in wa}
    scale = max(float(wa[k].abs().max()) for k in wa)
    worst = max(diff, key=diff.get)
    return {"max_abs": diff[worst], "tensor": worst, "identical_tensors": sum(v == 0 for v in diff.values()),
            "tensors": len(diff), "largest_weight": scale}


def main(argv=None) -> dict:
    ap = Parser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=80, help="optimiser steps (the demo's phase 1: 80)")
    ap.add_argument("--out", type=Path, default=None, help="keep the three runs here (default: a temporary directory)")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    ap.add_argument("--threads", type=int, default=1,
                    help="intra-op threads of each run (one: a shared machine's load slows it least; same for all three)")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.threads < 1:
        ap.error(f"--steps and --threads must be at least 1, got {args.steps} and {args.threads}")
    if args.out is not None and args.out.exists() and any(args.out.iterdir()):
        ap.error(f"--out {args.out} is not empty: pass a new directory")
    if args.json is not None and not args.json.parent.is_dir():
        ap.error(f"--json {args.json}: its directory does not exist")
    with tempfile.TemporaryDirectory() as tmp:
        root = args.out or Path(tmp)
        load = [round(x, 2) for x in os.getloadavg()]
        wall = {mode: round(train(mode, args.steps, root / mode, args.threads), 1) for mode in MODES}
        figures = {"steps": args.steps, "threads": args.threads, "load_average": {"start": load, "end": [round(x, 2) for x in os.getloadavg()]},
                   "wall_s": wall, **{f"eager_vs_{m}": largest_differences(root / "false", root / m) for m in MODES[1:]}}
    print(json.dumps(figures, indent=2))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return figures


if __name__ == "__main__":
    main()
