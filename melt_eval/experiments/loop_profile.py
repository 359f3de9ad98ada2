"""Where a looped model does its work: each loop's next-token loss and greedy error on reply tokens.

Teacher-forced on chats from a recipe's data (the synthetic task's train split by default), a checkpoint
runs as it decodes (Ouro with its per-loop cache, MELT one token per chunk) and each loop's logits are
scored. A teacher that is already right at loops 2-3 works early; one near chance until loop 4 works
late; with 200 phase-1 steps the demo's conversion kept far more of a late teacher's accuracy than of
early ones' (docs/results/demo-history.md). The demo records both of its models' profiles (`demo.json`,
`loop_profile`); `scripts/loop_predictions.py` prints them for any checkpoints.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SEQUENCES = 48  # chats per profile: ~4,000 reply tokens, enough to tell the loops apart, cheap beside an evaluation


def reply_batch(tokenizer, recipe: str = "tiny-phase1", sequences: int = SEQUENCES, seed: int = 123) -> dict[str, torch.Tensor]:
    """`sequences` chats from `recipe`'s data, tokenized and right-padded, with their reply-token mask."""
    from melt_eval.training.config import load_recipe
    from melt_eval.training.data import DataStream, collate

    r = load_recipe(recipe)
    stream = DataStream(r.data, tokenizer, r.seq_len, seed=seed)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return collate([stream.next() for _ in range(sequences)], pad)


@torch.no_grad()
def loop_profile(model, batch: dict[str, torch.Tensor], first_chunk: int = 0) -> list[dict]:
    """Per loop t = 1..T: reply loss (nats/token), greedy error rate, and the mean distance of the loop's
    output to the last loop's, ||h_t - h_T|| / ||h_T|| over real tokens. `first_chunk`: the prompt's
    length where it is prefilled as one chunk (MELT; the model's forward)."""
    ids, real = batch["input_ids"], batch["attention_mask"].bool()
    scored = batch["loss_mask"][:, 1:].bool() & real[:, 1:]  # position n predicts token n + 1
    targets = ids[:, 1:][scored]
    out = model(ids, attention_mask=batch["attention_mask"], output_loop_states=True, first_chunk=first_chunk)
    last = out.hidden_states[-1]
    rows = []
    for t, (logits, h) in enumerate(zip(out.loop_logits, out.hidden_states), start=1):
        picked = logits[:, :-1][scored]
        distance = ((h - last).norm(dim=-1) / last.norm(dim=-1))[real].mean()
        rows.append({"loop": t, "reply_loss": F.cross_entropy(picked.float(), targets).item(),
                     "greedy_error": (picked.argmax(-1) != targets).float().mean().item(),
                     "distance_to_last": distance.item()})
    return rows


def checkpoint_profile(model_dir: str, recipe: str = "tiny-phase1", sequences: int = SEQUENCES, seed: int = 123) -> list[dict]:
    """`loop_profile` of a checkpoint (a directory or registry name) on `sequences` chats of `recipe`'s data."""
    from melt_eval.modeling import load_model
    from melt_eval.training.config import load_recipe
    from melt_eval.training.data import prompt_length

    model, tokenizer = load_model(model_dir)
    model.eval()
    batch = reply_batch(tokenizer, recipe, sequences, seed)
    first_chunk = prompt_length(batch["loss_mask"]) if load_recipe(recipe).prompt_as_one_chunk else 0
    return loop_profile(model, batch, first_chunk)


def summary_line(rows: list[dict]) -> str:
    """'4.53 / 4.03 / 0.89 / 0.000': the reply loss at each loop."""
    return " / ".join(f"{r['reply_loss']:.3f}" if r["reply_loss"] < 0.1 else f"{r['reply_loss']:.2f}" for r in rows)
