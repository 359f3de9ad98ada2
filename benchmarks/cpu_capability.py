"""What the pinned float path costs: the demo's work on it against the CPU's own path, in one run.

The pin (melt_eval/float_path.py: ATen's AVX2 kernels, MKL's AVX2 CNR branch, a fixed thread count) is read once
per process, so every measurement is a child process; the two kinds alternate, `--rounds` times each. A child does:

0. `--steps` pretrain-tiny steps (the teacher, which the demo trains in its own process, with its threads);
1. `--steps` tiny-phase1 training steps from tiny-random-ouro (16 synthetic chats, chunk 1 after a whole
   prompt) at one thread, as the demo's side-by-side jobs, the median after two warm-up steps;
2. 16 samples (temperature 1.0, top-p 0.7, 96 new tokens) for each of `--problems` synthetic prompts with a
   MELT model of the demo's size (`demo_speedups.demo_sized_melt_and_prompts`).

    python benchmarks/cpu_capability.py [--steps 6] [--rounds 2] [--problems 50] [--json]

The two kinds compute different floats (docs/reproducibility.md); this measures only their time.
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
from _args import Parser  # noqa: E402  (benchmarks/: the script's own folder)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

KINDS = {"pinned": {}, "the CPU's own": {"MELT_EVAL_FLOAT_PATH": "native"}}
PIN_VARIABLES = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "OMP_NUM_THREADS", "MELT_EVAL_FLOAT_PATH")


def _median_step(recipe: str, steps: int, overrides: dict) -> float:
    from melt_eval.training import run_recipe

    with tempfile.TemporaryDirectory() as tmp:
        run_recipe(recipe, "tiny-random-ouro", Path(tmp), progress=False,
                   overrides={"max_steps": steps + 2, "save_every": 0, "tensorboard": False, **overrides})
        rows = [json.loads(line) for line in (Path(tmp) / "logs" / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(row["step_time_s"] for row in rows[2:])  # the first two steps warm up


def child(steps: int, problems: int) -> dict:
    from melt_eval import float_path

    float_path.pin()  # as melt_eval.cli does before torch loads; a no-op under MELT_EVAL_FLOAT_PATH=native
    import torch

    from demo_speedups import demo_sized_melt_and_prompts
    from melt_eval.generation import engine
    from melt_eval.generation.options import InferenceOptions

    path = float_path.describe()
    # the teacher trains in the demo's own process, with its threads; the rest runs in one-thread jobs
    teacher = _median_step("pretrain-tiny", steps, {"stop_at_heldout": None})
    torch.set_num_threads(1)
    step = _median_step("tiny-phase1", steps, {"interpolation_steps": 0})
    model, prompts, seq_len = demo_sized_melt_and_prompts(problems)
    t0 = time.perf_counter()
    engine.generate(model, prompts, InferenceOptions(prefill_chunk=seq_len), n=16, temperature=1.0, top_p=0.7,
                    max_new_tokens=96, seed=0)
    return {"float_path": path, "teacher_step_s": teacher, "step_s": step, "generation_s": time.perf_counter() - t0}


def measure(extra: dict, steps: int, problems: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in PIN_VARIABLES}
    env.update(extra)
    out = subprocess.run([sys.executable, __file__, "--child", "--steps", str(steps), "--problems", str(problems)],
                         env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> dict:
    ap = Parser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=6, help="timed training steps per child")
    ap.add_argument("--rounds", type=int, default=2, help="children per kind, the kinds alternating")
    ap.add_argument("--problems", type=int, default=50)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for name in ("steps", "rounds", "problems"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.child:
        print(json.dumps(child(args.steps, args.problems)))
        return {}

    load = [round(x, 2) for x in os.getloadavg()]
    runs: dict[str, list[dict]] = {label: [] for label in KINDS}
    for _ in range(args.rounds):
        for label, extra in KINDS.items():
            runs[label].append(measure(extra, args.steps, args.problems))
    out = {label: {"float_path": rs[0]["float_path"],
                   "teacher_step_s": round(statistics.median(r["teacher_step_s"] for r in rs), 3),
                   "training_step_s": round(statistics.median(r["step_s"] for r in rs), 3),
                   "generation_s": round(statistics.median(r["generation_s"] for r in rs), 2)} for label, rs in runs.items()}
    out = {"kinds": out, "machine": f"{platform.machine()} CPU, {os.cpu_count()} cores",
           "load_average": {"start": load, "end": [round(x, 2) for x in os.getloadavg()]}}
    if args.json:
        print(json.dumps(out))
        return out
    print(f"{out['machine']}; load average {load[0]} at the start, {out['load_average']['end'][0]} at the end")
    base = out["kinds"]["the CPU's own"]
    for label, k in out["kinds"].items():
        fp = k["float_path"]
        print(f"  {label} ({fp['kernels']} kernels, MKL branch {fp['mkl_branch']}, {fp['threads']} threads): "
              f"teacher step {k['teacher_step_s']:.3f} s ({k['teacher_step_s'] / base['teacher_step_s']:.3f}x), "
              f"tiny-phase1 step at one thread {k['training_step_s']:.3f} s "
              f"({k['training_step_s'] / base['training_step_s']:.3f}x), generation of {args.problems} prompts x 16 "
              f"{k['generation_s']:.2f} s ({k['generation_s'] / base['generation_s']:.3f}x)")
    return out


if __name__ == "__main__":
    main()
