"""The wheel is what `pip install melt-eval` (without -e) gets: every training recipe and the
Accelerate config must be inside it, where RECIPES_DIR looks for them."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from melt_eval.training.config import RECIPES_DIR

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_ships_every_recipe_and_the_accelerate_config(tmp_path):
    # build from a copy: setuptools writes build/ and *.egg-info beside the sources
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for package in ("melt_eval", "tasks"):
        shutil.copytree(ROOT / package, src / package, ignore=ignore)
    out = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(src)],
                   check=True, capture_output=True, timeout=300)
    (wheel,) = out.glob("melt_eval-*.whl")
    shipped = set(zipfile.ZipFile(wheel).namelist())

    recipes = sorted(RECIPES_DIR.rglob("*.yaml"))
    assert RECIPES_DIR == ROOT / "melt_eval" / "recipes"
    assert {"paper-phase1.yaml", "paper-phase2.yaml", "tiny-phase1.yaml"} <= {p.name for p in recipes}
    assert RECIPES_DIR / "accelerate" / "fsdp.yaml" in recipes
    missing = [str(p.relative_to(ROOT)) for p in recipes if p.relative_to(ROOT).as_posix() not in shipped]
    assert not missing, f"not in the wheel: {missing}"
