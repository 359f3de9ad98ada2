"""Screen the demo teacher's stopping rule (recipe key stop_at_heldout, issue 51): train `pretrain-tiny` at one
seed with held-out checks every K steps and a checkpoint at each, then, for each candidate target, score the
state the rule would have stopped at on the test split (pass@1 at T = 1 and T = 4, the native engine, the
demo's sampling; benchmarks/demo_task_screen.py's scorer).

    python benchmarks/demo_teacher_stop.py --seed 0 --out /work/screens/stop-s0 --targets 0.6,0.7,0.8,0.9

Training stops at the highest target (or max_steps), so each lower target's stop is one of its checkpoints.
Prints one JSON line; writes OUT/stop_screen.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    ap.add_argument("--targets", default="0.6,0.7,0.8,0.9", help="held-out pass@1 targets to score, comma-separated")
    ap.add_argument("--every", type=int, default=50)
    ap.add_argument("--problems", type=int, default=23)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--test-problems", type=int, default=100)
    ap.add_argument("--test-samples", type=int, default=4)
    a = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    sys.path.insert(0, str(Path(__file__).parent))
    from demo_task_screen import evaluate

    from melt_eval.training import run_recipe
    from melt_eval.training.runner import logged_checks

    out = Path(a.out)
    targets = sorted(float(t) for t in a.targets.split(","))
    rule = {"loops": 4, "target": targets[-1], "every": a.every, "problems": a.problems, "samples": a.samples}
    overrides = {"stop_at_heldout": rule, "save_every": a.every, "keep_checkpoints": 1000,
                 **({"seed": a.seed} if a.seed else {})}
    record = {"seed": a.seed, "rule": rule, "load_start": os.getloadavg()}
    t0 = time.perf_counter()
    if not (out / "train" / "config.json").exists():
        run_recipe("pretrain-tiny", "tiny-random-ouro", out / "train", overrides=overrides, progress=True)
    record["train_s"] = round(time.perf_counter() - t0, 1)
    record["load_end_train"] = os.getloadavg()
    checks = logged_checks(out / "train")
    record["checks"] = [(c["step"], c["pass@1"], c["seconds"]) for c in checks]
    # the screener's scorer: the test split's first --test-problems, --test-samples each, at T = 1 and 4
    score_args = argparse.Namespace(steps="5,7", problems=a.test_problems, max_value=9, form="digit-sum", samples=a.test_samples,
                                    max_new_tokens=96, seq_len=112, loops="1,4")
    record["targets"], scored = {}, {}
    for target in targets:
        step = next((c["step"] for c in checks if c["pass@1"] >= target), None)
        if step is None:
            record["targets"][str(target)] = None
            continue
        state = out / "train" / "checkpoints" / f"step-{step:06d}" / "state" / "model.safetensors"
        scratch = out / f"stopped-{step}"
        if not scratch.exists():
            shutil.copytree(out / "train", scratch, ignore=shutil.ignore_patterns("checkpoints", "logs"))
            shutil.copy(state, scratch / "model.safetensors")
            (scratch / "SHA256SUMS").unlink(missing_ok=True)  # they name the final weights
        scores = scored[step] = scored.get(step) or evaluate(scratch, score_args)  # two targets, one stop: scored once
        record["targets"][str(target)] = {"step": step, "T=1": scores["T=1"], "T=4": scores["T=4"]}
    record["load_end"] = os.getloadavg()
    print(json.dumps(record))
    (out / "stop_screen.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
