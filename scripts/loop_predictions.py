"""Where a looped model does its work: each loop's reply loss, greedy error and distance to the last loop.

Teacher-forced on chats from a recipe's data (`melt_eval.experiments.loop_profile`);
docs/results/demo-history.md compares the demo's teachers and MELT models with it.

    .venv/bin/python scripts/loop_predictions.py demo/runs/pretrain-tiny-* demo-seed1/runs/pretrain-tiny-*
    .venv/bin/python scripts/loop_predictions.py CKPT --sequences 96 --format json
"""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    from melt_eval.errors import UserError
    from melt_eval.experiments.loop_profile import SEQUENCES, checkpoint_profile

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoints", nargs="+", help="model directories or registry names")
    p.add_argument("--recipe", default="tiny-phase1", help="recipe whose data the chats come from")
    p.add_argument("--sequences", type=int, default=SEQUENCES)
    p.add_argument("--seed", type=int, default=123, help="data order")
    p.add_argument("--format", choices=("table", "json"), default="table")
    args = p.parse_args(argv)
    results = {}
    for ckpt in args.checkpoints:
        try:
            results[ckpt] = checkpoint_profile(ckpt, args.recipe, args.sequences, args.seed)
        except UserError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    if args.format == "json":
        print(json.dumps(results, indent=2))
        return 0
    print("| checkpoint | loop | reply loss | greedy error | distance to last loop |")
    print("| --- | --- | --- | --- | --- |")
    for ckpt, rows in results.items():
        for r in rows:
            print(f"| {ckpt} | {r['loop']} | {r['reply_loss']:.3f} | {100 * r['greedy_error']:.2f}% | {r['distance_to_last']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
