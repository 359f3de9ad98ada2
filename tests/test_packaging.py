"""The wheel is what `pip install melt-eval` (without -e) gets: every training recipe and the
Accelerate config must be inside it, where RECIPES_DIR looks for them. And what users read first: the
README stays short, keeps the two commands CI runs, and no relative link in it or in docs/ is dead."""

import re
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


# --- the README and docs/ (issue 37): users' page short, its two commands the ones CI runs, no dead links ---

SETUP_AND_DEMO = "bash scripts/setup.sh && .venv/bin/melt-eval demo"
TESTS = ".venv/bin/python -m pytest -q -n 2 --dist loadfile"
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    in_code = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_code = not in_code
        m = re.match(r"#{1,6} (.+)", line)
        if m and not in_code:
            slug = _slug(m.group(1))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def _markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_readme_is_short_and_keeps_the_commands_ci_runs():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 200, "README.md is for users: at most 200 lines (measurements go to docs/results/)"
    lines = [line.strip() for line in readme.splitlines()]
    assert SETUP_AND_DEMO in lines and TESTS in lines
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert "bash scripts/setup.sh" in ci and TESTS in ci


def test_every_relative_link_in_the_readme_and_docs_resolves():
    dead = []
    for md in _markdown_files():
        text = re.sub(r"```.*?```", "", md.read_text(encoding="utf-8"), flags=re.S)
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (md.parent / path).resolve() if path else md
            if not dest.exists():
                dead.append(f"{md.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                dead.append(f"{md.relative_to(ROOT)}: {target} (no such heading)")
    assert not dead, "dead links:\n" + "\n".join(dead)
