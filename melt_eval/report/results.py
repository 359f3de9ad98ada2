"""Reading a results directory (docs/CONTRACTS.md "Results files").

Layout: `<root>/<model>/<task>/results.json` and `<root>/ablations/<ablation>/<variant>/<task>/results.json`.
Anything else holding a results.json (e.g. runs at other loop counts) is still read for the loops
figure, which groups by the file's own `model` and `settings.loops` fields.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from melt_eval.report.paper import canonical_task


@dataclass
class Result:
    path: Path
    model: str
    task: str  # paper benchmark key where it is one, else the directory's name
    finished: bool
    metrics: dict[str, tuple[float, float | None]]  # name -> (value, stderr), fractions in [0, 1]
    settings: dict
    raw: dict

    def metric(self, name: str) -> tuple[float, float | None] | None:
        if name in self.metrics:
            return self.metrics[name]
        # One-sample tasks: pass@1 over one sample is the accuracy.
        if name == "accuracy" and "pass@1" in self.metrics:
            return self.metrics["pass@1"]
        return None


@dataclass
class ResultSet:
    root: Path
    main: dict[tuple[str, str], Result] = field(default_factory=dict)  # (model dir, task)
    ablations: dict[tuple[str, str, str], Result] = field(default_factory=dict)  # (ablation, variant, task)
    every: list[Result] = field(default_factory=list)  # every finished results.json under root
    unfinished: list[Path] = field(default_factory=list)
    unreadable: list[str] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.every

    def main_models(self) -> list[str]:
        return list(dict.fromkeys(m for m, _ in self.main))

    def loop_sweep_dirs(self) -> set[str]:
        """Model directories that hold another directory's checkpoint run at a different loop count
        (`run --loops T --name X-T2`): the loops figure shows them, the model tables do not."""
        by_path: dict[tuple, set] = {}
        for (d, _), r in self.main.items():
            if r.raw.get("model_path"):
                key = (r.raw["model_path"], r.settings.get("kv_sharing"), bool(r.settings.get("share_prompt")))
                by_path.setdefault(key, set()).add((d, r.settings.get("loops")))
        sweeps = set()
        for members in by_path.values():
            if len({loops for _, loops in members}) < 2:
                continue
            # the directory with the shortest name is the model itself; the others are its sweeps
            base = min((d for d, _ in members), key=len)
            base_loops = {loops for d, loops in members if d == base}
            sweeps |= {d for d, loops in members if d != base and loops not in base_loops}
        return sweeps

    def ablation_variants(self, ablation: str) -> list[str]:
        return list(dict.fromkeys(v for a, v, _ in self.ablations if a == ablation))


def _read(path: Path, task_dir: str) -> Result:
    raw = json.loads(path.read_text(encoding="utf-8"))
    metrics = {}
    for name, m in (raw.get("metrics") or {}).items():
        if isinstance(m, dict) and m.get("value") is not None:
            metrics[name] = (float(m["value"]), None if m.get("stderr") is None else float(m["stderr"]))
        elif isinstance(m, (int, float)):
            metrics[name] = (float(m), None)
    return Result(
        path=path,
        model=str(raw.get("model") or path.parent.parent.name),
        task=canonical_task(task_dir) or task_dir,
        finished=bool(raw.get("finished", True)),
        metrics=metrics,
        settings=raw.get("settings") or {},
        raw=raw,
    )


def load_results(root: str | Path) -> ResultSet:
    root = Path(root)
    rs = ResultSet(root=root)
    if not root.is_dir():
        return rs
    for path in sorted(root.rglob("results.json")):
        rel = path.relative_to(root).parts
        try:
            res = _read(path, rel[-2] if len(rel) >= 2 else "")
        except (OSError, ValueError, TypeError) as exc:
            rs.unreadable.append(f"{path}: {type(exc).__name__}")
            continue
        if not res.finished:  # a half-finished run's numbers would mislead; it shows as n/a
            rs.unfinished.append(path)
            continue
        rs.every.append(res)
        if len(rel) == 3 and rel[0] != "ablations":
            rs.main[(rel[0], res.task)] = res
        elif len(rel) == 5 and rel[0] == "ablations":
            rs.ablations[(rel[1], rel[2], res.task)] = res
    return rs
