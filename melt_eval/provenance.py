"""What produced a file: package versions and the harness's git state, recorded beside results
(`results.json["versions"]`, and its top-level "git_commit" and "git_dirty") and training outputs
(`melt_eval_train.json["code"]`)."""

from __future__ import annotations

import platform
import subprocess
from importlib import metadata
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parent  # melt_eval/: the recipes are inside it


def package_versions(names, *, python: bool = False) -> dict:
    """{name: installed version} for each distribution installed (others left out); "python" first if asked."""
    out = {"python": platform.python_version()} if python else {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


def git_state() -> dict:
    """{"git_sha", "git_dirty"} of the checkout the package runs from (git_dirty: uncommitted changes under
    melt_eval/); {"git_sha": None} where git is missing or fails."""
    root = str(PACKAGE_ROOT.parent)
    try:
        sha = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--", "melt_eval"], capture_output=True, text=True,
                               timeout=10).stdout
        return {"git_sha": sha or None, "git_dirty": bool(dirty.strip())}
    except (OSError, subprocess.SubprocessError):
        return {"git_sha": None}
