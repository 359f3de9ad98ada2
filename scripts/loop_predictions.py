"""Where a looped model computes: each loop's next-token loss and greedy error on reply tokens.

Teacher-forced on chats from a recipe's data (the synthetic task's train split by default), every
checkpoint is run as it decodes (Ouro with its per-loop cache, MELT with chunk 1) and each loop's
logits are scored: a teacher that is right at loop 2 or 3 already does its work in the early loops,
one that is near chance until loop 4 does it late. Also printed: how far each loop's output is from
the last one's (mean of ||h_t - h_T|| / ||h_T|| over tokens). The demo's README compares its
teachers with it.

    .venv/bin/python scripts/loop_predictions.py demo/runs/pretrain-tiny-* demo-seed1/runs/pretrain-tiny-*
    .venv/bin/python scripts/loop_predictions.py CKPT --sequences 96 --format json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F


def reply_batch(tokenizer, recipe: str = "tiny-phase1", sequences: int = 48, seed: int = 123) -> dict[str, torch.Tensor]:
    """`sequences` chats from `recipe`'s data, tokenized and right-padded, with their reply-token mask."""
    from melt_eval.training.config import load_recipe
    from melt_eval.training.data import DataStream, collate

    r = load_recipe(recipe)
    stream = DataStream(r.data, tokenizer, r.seq_len, seed=seed)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return collate([stream.next() for _ in range(sequences)], pad)


@torch.no_grad()
def loop_predictions(model, batch: dict[str, torch.Tensor]) -> list[dict]:
    """Per loop t = 1..T: reply loss (nats/token), greedy error rate, distance of h_t to h_T."""
    ids, real = batch["input_ids"], batch["attention_mask"].bool()
    scored = batch["loss_mask"][:, 1:].bool() & real[:, 1:]  # position n predicts token n + 1
    targets = ids[:, 1:][scored]
    out = model(ids, attention_mask=batch["attention_mask"], output_loop_states=True)
    last = out.hidden_states[-1]
    rows = []
    for t, (logits, h) in enumerate(zip(out.loop_logits, out.hidden_states), start=1):
        picked = logits[:, :-1][scored]
        distance = ((h - last).norm(dim=-1) / last.norm(dim=-1))[real].mean()
        rows.append({"loop": t, "reply_loss": F.cross_entropy(picked.float(), targets).item(),
                     "greedy_error": (picked.argmax(-1) != targets).float().mean().item(),
                     "distance_to_last": distance.item()})
    return rows


def main(argv: list[str] | None = None) -> int:
    from melt_eval.errors import UserError
    from melt_eval.modeling import load_model

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoints", nargs="+", help="model directories or registry names")
    p.add_argument("--recipe", default="tiny-phase1", help="recipe whose data the chats come from")
    p.add_argument("--sequences", type=int, default=48)
    p.add_argument("--seed", type=int, default=123, help="data order")
    p.add_argument("--format", choices=("table", "json"), default="table")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    results = {}
    for ckpt in args.checkpoints:
        try:
            model, tokenizer = load_model(ckpt)
        except UserError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        model.eval()
        results[ckpt] = loop_predictions(model, reply_batch(tokenizer, args.recipe, args.sequences, args.seed))
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
