"""Issue 38 item 6: `ablate --preset paper` prints FSDP launch lines; trackers; the model card and --push-to-hub."""

from __future__ import annotations

from pathlib import Path

from melt_eval.experiments import ablations
from melt_eval.training.runs import FSDP_LAUNCH, train_command


def test_paper_preset_prints_fsdp_launch(tmp_path: Path) -> None:
    for preset, launcher in (("paper", FSDP_LAUNCH), ("tiny", "melt-eval train")):
        variants = ablations.plan("gates", preset=preset)
        rows = ablations.describe(variants, tmp_path / "runs", tmp_path / "out", "synthetic", "native")
        trains = [r["command"] for r in rows if r["step"].startswith("train")]
        assert trains and all(c.startswith(launcher + " --recipe") for c in trains), trains
    assert FSDP_LAUNCH.startswith("accelerate launch --config_file melt_eval/recipes/accelerate/fsdp.yaml -m melt_eval.cli train")
    assert Path(__file__).parent.parent.joinpath("melt_eval/recipes/accelerate/fsdp.yaml").exists()
    assert train_command("tiny-phase1", "m", Path("o"), {}) == "melt-eval train --recipe tiny-phase1 --from m --output o"


def _meta() -> dict:
    return {"status": "finished", "target": "melt", "phase": 1, "steps": 3, "tokens_seen": 1234,
            "from_model": "ouro-1.4b-thinking", "teacher": "ouro-1.4b-thinking",
            "recipe": {"gate": "elementwise", "chunk_size": 8}, "code": {"git_sha": "abc1234"}}


def test_model_card_written(tmp_path: Path) -> None:
    from melt_eval.training.publish import write_model_card

    text = write_model_card(tmp_path, _meta(), "me/melt-test").read_text()
    for want in ("ouro-1.4b-thinking", "| phase | 1 |", "| steps | 3 |", "| tokens seen | 1234 |", "abc1234",
                 "Memory-Efficient Looped Transformer: Decoupling Compute from Memory", "melt-eval", "me/melt-test"):
        assert want in text, want


def test_push_fails_offline_in_one_line(tmp_path: Path, monkeypatch) -> None:
    import time

    import pytest

    from melt_eval.errors import UserError
    from melt_eval.training.publish import push_to_hub

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub

    class Offline:  # no network in tests, whatever the huggingface_hub version does offline
        def create_repo(self, *a, **k):
            raise huggingface_hub.errors.OfflineModeIsEnabled("Cannot reach https://huggingface.co: offline mode is enabled.\nmore")

        def upload_folder(self, **k):
            raise AssertionError("not reached")

    monkeypatch.setattr(huggingface_hub, "HfApi", Offline)
    run = tmp_path / "melt-run"
    run.mkdir()
    t = time.monotonic()
    with pytest.raises(UserError) as err:
        push_to_hub(run)
    msg = str(err.value)
    assert "\n" not in msg and "melt-run" in msg and f"saved locally in {run}" in msg
    assert time.monotonic() - t < 5


def test_log_with_resolves_trackers(tmp_path: Path) -> None:
    import importlib.util

    from melt_eval.errors import UserError
    from melt_eval.training.config import load_recipe
    from melt_eval.training.metrics import scalars, trackers

    has_tb = importlib.util.find_spec("tensorboard") is not None
    auto = trackers("auto", True, tmp_path)
    assert [getattr(t, "name", t) for t in auto] == (["tensorboard"] if has_tb else [])
    assert trackers("auto", False, tmp_path) == []  # the older tensorboard: false key
    assert trackers("none", True, tmp_path) == []
    assert [getattr(t, "name", t) for t in trackers("wandb,tensorboard", True, tmp_path)] == ["tensorboard", "wandb"]
    import pytest

    with pytest.raises(UserError, match="log_with"):
        load_recipe("tiny-phase1", overrides={"log_with": "nope"})
    assert scalars({"step": 2, "loss": 1.0, "lr.base": 0.1, "gate_mean": {"layer0": [None, 0.5]}}) == \
        {"loss": 1.0, "lr/base": 0.1, "gate/layer0/loop2": 0.5}


def test_finished_run_writes_card_and_failed_push_keeps_it(tmp_path: Path, monkeypatch, one_thread) -> None:
    import json

    import huggingface_hub
    import pytest

    from melt_eval.errors import UserError
    from melt_eval.training import run_recipe

    class Offline:
        def create_repo(self, *a, **k):
            raise OSError("no network")

    monkeypatch.setattr(huggingface_hub, "HfApi", Offline)
    out = tmp_path / "run"
    overrides = {"seq_len": 64, "micro_batch_size": 4, "batch_tokens": 256, "warmup_steps": 1, "max_steps": 2,
                 "data": [{"source": "synthetic", "n": 100, "num_steps": 1}]}
    with pytest.raises(UserError, match=f"could not push to run .*saved locally in {out}"):
        run_recipe("tiny-phase1", "tiny-random-ouro", output=out, overrides=overrides, progress=False, push_to_hub=True)
    assert json.loads((out / "melt_eval_training.json").read_text())["status"] == "finished"
    card = (out / "README.md").read_text()
    assert "tiny-random-ouro" in card and "| steps | 2 |" in card
    assert list((out / "logs" / "tb").glob("events.*")) and (out / "logs" / "metrics.jsonl").exists()
