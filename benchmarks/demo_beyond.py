"""What `melt-eval demo --beyond-paper` adds, as a multiple of one of the paper's evaluations, in one run.

Each of the stage's rows on a checkpoint (`demo.BEYOND_EXIT`, and the `demo.BEYOND_KV` rows of its model type)
and the checkpoint's full-depth evaluation (what the paper's rows are), all evaluated exactly as the demo does
(`demo.eval_settings(FULL)`: 16 samples, temperature 1.0, top-p 0.7, the prompt whole) on the first
`--problems` test problems, each into a fresh directory (nothing is read back), the variants interleaved
`--repeats` times (each round starting at the next variant), one torch thread. The median wall time of each over the full-depth one is the figure: it
says how many of the paper's evaluations the stage costs, without the machine's load in the ratio.

    python benchmarks/demo_beyond.py --model DEMO/runs/<teacher run> [--problems 20] [--repeats 2] [--json]

Use a trained checkpoint (the demo's teacher or MELT run): a model that stops early generates fewer tokens,
and early exit's cost depends on where tokens stop.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def variants(model: str) -> dict[str, dict]:
    """{label: inference options}: full depth first, then the stage's rows for this model type."""
    from melt_eval.experiments import demo
    from melt_eval.modeling.loading import read_config, resolve_model_dir
    from melt_eval.protocol import variants as definitions

    kind = "melt" if read_config(resolve_model_dir(model)).get("model_type") == "melt" else "ouro"
    rows = {"full depth": {}}
    rows.update({f"exit {row}": dict(definitions.variant("exit", row).eval_options) for row in demo.BEYOND_EXIT})
    rows.update({f"cache {row}": dict(definitions.variant("kv-compression", row).eval_options)
                 for row in demo.BEYOND_KV if row.startswith(kind)})
    return rows


def measure(model: str, problems: int, repeats: int) -> dict:
    import torch

    from melt_eval.evaluation import RunPaths, run_tasks
    from melt_eval.experiments import demo
    from melt_eval.generation.options import InferenceOptions

    torch.set_num_threads(1)
    settings = demo.eval_settings(demo.FULL)
    settings.pop("max_problems")
    times: dict[str, list[float]] = {}
    extra: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        rows = list(variants(model).items())
        for r in range(repeats):
            # each repeat starts at another variant: a load that rises or falls during a round hits none of them alone
            for label, options in rows[r % len(rows):] + rows[:r % len(rows)]:
                start = time.perf_counter()
                [res] = run_tasks(demo.TASK, model, InferenceOptions.from_flags(**settings, **options),
                                  RunPaths(results_dir=Path(tmp) / f"{r}-{label}"), max_problems=problems, progress=False)
                times.setdefault(label, []).append(time.perf_counter() - start)
                extra[label] = {"pass@1": res["metrics"]["pass@1"]["value"], "tokens": res.get("generated_tokens"),
                                "loops_per_token": (res.get("loops_per_token") or {}).get("mean")}
    full = statistics.median(times["full depth"])
    return {label: {"median_s": statistics.median(ts), "x_full_depth": statistics.median(ts) / full, **extra[label]}
            for label, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a trained checkpoint (the demo's teacher or MELT run)")
    parser.add_argument("--problems", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    load = os.getloadavg()
    got = measure(args.model, args.problems, args.repeats)
    after = os.getloadavg()
    if args.json:
        print(json.dumps({"load_before": load, "load_after": after, "rows": got}, indent=1))
        return
    print(f"load average before {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, after {after[0]:.2f} {after[1]:.2f} {after[2]:.2f}")
    print("| variant | median s | x full depth | pass@1 | tokens | loops / token |")
    print("| --- | --: | --: | --: | --: | --: |")
    for label, row in got.items():
        loops = "" if row["loops_per_token"] is None else f"{row['loops_per_token']:.2f}"
        print(f"| {label} | {row['median_s']:.1f} | {row['x_full_depth']:.2f} | {100 * row['pass@1']:.1f} | "
              f"{row['tokens']} | {loops} |")


if __name__ == "__main__":
    main()
