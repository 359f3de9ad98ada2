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
