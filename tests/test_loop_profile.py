"""Each loop's reply loss and error (`melt_eval.experiments.loop_profile`, `scripts/loop_predictions.py`), as
the demo records them and docs/results/demo-history.md's teacher comparison reads them."""

import importlib.util
from pathlib import Path

import torch
import torch.nn.functional as F

from melt_eval.experiments.loop_profile import loop_profile, summary_line

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "loop_predictions.py"


def _script():
    spec = importlib.util.spec_from_file_location("loop_predictions", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_each_loop_is_scored_on_reply_tokens_only(random_looplm, training_batch, one_thread):
    model = random_looplm(0.2).eval()
    batch = training_batch(12, pad_from=9, loss_from=(4, 3))
    rows = loop_profile(model, batch)

    assert [r["loop"] for r in rows] == list(range(1, model.config.total_ut_steps + 1))
    assert rows[-1]["distance_to_last"] == 0.0 and all(r["distance_to_last"] > 0 for r in rows[:-1])
    # the last loop's figures are the model's own output scored on the reply tokens, padding left out
    with torch.no_grad():
        logits = model(batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    scored = batch["loss_mask"][:, 1:] & batch["attention_mask"][:, 1:]
    picked, targets = logits[:, :-1][scored], batch["input_ids"][:, 1:][scored]
    assert abs(rows[-1]["reply_loss"] - F.cross_entropy(picked, targets).item()) < 1e-5
    assert rows[-1]["greedy_error"] == (picked.argmax(-1) != targets).float().mean().item()
    # an earlier loop reads other logits
    assert rows[0]["reply_loss"] != rows[-1]["reply_loss"]
    assert summary_line(rows).count(" / ") == len(rows) - 1


def test_tiny_checkpoint_end_to_end(tmp_path, capsys, one_thread):
    from melt_eval.modeling.tiny import build_tokenizer, make_tiny_looplm

    tok = build_tokenizer()
    model = make_tiny_looplm(tok)
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    assert _script().main([str(tmp_path / "m"), "--sequences", "4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 + model.config.total_ut_steps  # header, rule, a row per loop


def test_missing_checkpoint_is_one_line_and_exit_2(tmp_path, capsys):
    assert _script().main([str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:")
