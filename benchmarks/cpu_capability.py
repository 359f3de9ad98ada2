"""The demo's work with PyTorch's AVX2 kernels against the CPU's own (AVX-512 where it has them), in one run.

PyTorch reads `ATEN_CPU_CAPABILITY` once per process, so every measurement is a child process; the two kinds
alternate, `--rounds` times each. A child does, with one torch thread as the demo's side-by-side workers:

1. `--steps` tiny-phase1 training steps from tiny-random-ouro (16 synthetic chats, chunk 1 after a whole
   prompt), the median after two warm-up steps;
2. 16 samples (temperature 1.0, top-p 0.7, 96 new tokens) for each of `--problems` synthetic prompts with a
   MELT model of the demo's size (`demo_speedups.demo_sized_melt_and_prompts`).

    python benchmarks/cpu_capability.py [--steps 6] [--rounds 2] [--problems 50] [--json]

The two kinds compute different floats (docs/results/2026-11-26-demo-seeds.md#another-cpus-floats-the-five-seeds-with-avx2-kernels);
this measures only their time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

KINDS = {"the CPU's own": None, "AVX2": "avx2"}


def child(steps: int, problems: int) -> dict:
    import torch

    from demo_speedups import demo_sized_melt_and_prompts
    from melt_eval.generation import engine
    from melt_eval.generation.options import InferenceOptions
    from melt_eval.training import run_recipe

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        run_recipe("tiny-phase1", "tiny-random-ouro", Path(tmp), progress=False,
                   overrides={"max_steps": steps + 2, "interpolation_steps": 0, "save_every": 0, "tensorboard": False})
        rows = [json.loads(line) for line in (Path(tmp) / "logs" / "metrics.jsonl").read_text().splitlines()]
    step = statistics.median(row["step_time_s"] for row in rows[2:])  # the first two steps warm up
    model, prompts, seq_len = demo_sized_melt_and_prompts(problems)
    t0 = time.perf_counter()
    engine.generate(model, prompts, InferenceOptions(prefill_chunk=seq_len), n=16, temperature=1.0, top_p=0.7,
                    max_new_tokens=96, seed=0)
    return {"capability": torch.backends.cpu.get_cpu_capability(), "step_s": step,
            "generation_s": time.perf_counter() - t0}


def measure(kind: str | None, steps: int, problems: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    if kind:
        env["ATEN_CPU_CAPABILITY"] = kind
    out = subprocess.run([sys.executable, __file__, "--child", "--steps", str(steps), "--problems", str(problems)],
                         env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=6, help="timed training steps per child")
    ap.add_argument("--rounds", type=int, default=2, help="children per kind, the kinds alternating")
    ap.add_argument("--problems", type=int, default=50)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.steps, args.problems)))
        return {}

    load = [round(x, 2) for x in os.getloadavg()]
    runs: dict[str, list[dict]] = {label: [] for label in KINDS}
    for _ in range(args.rounds):
        for label, kind in KINDS.items():
            runs[label].append(measure(kind, args.steps, args.problems))
    out = {label: {"capability": rs[0]["capability"],
                   "training_step_s": round(statistics.median(r["step_s"] for r in rs), 3),
                   "generation_s": round(statistics.median(r["generation_s"] for r in rs), 2)} for label, rs in runs.items()}
    out = {"kinds": out, "machine": f"{platform.machine()} CPU, {os.cpu_count()} cores, one torch thread",
           "load_average": {"start": load, "end": [round(x, 2) for x in os.getloadavg()]}}
    if args.json:
        print(json.dumps(out))
        return out
    print(f"{out['machine']}; load average {load[0]} at the start, {out['load_average']['end'][0]} at the end")
    base = out["kinds"]["the CPU's own"]
    for label, k in out["kinds"].items():
        print(f"  {label} ({k['capability']}): tiny-phase1 step {k['training_step_s']:.3f} s "
              f"({k['training_step_s'] / base['training_step_s']:.2f}x), generation of {args.problems} prompts x 16 "
              f"{k['generation_s']:.2f} s ({k['generation_s'] / base['generation_s']:.2f}x)")
    return out


if __name__ == "__main__":
    main()
