"""Reading a results directory (docs/CONTRACTS.md "Results files").

Layout: `<root>/<model>/<task>/results.json` and `<root>/ablations/<ablation>/<variant>/<task>/results.json`.
Anything else holding a results.json (e.g. runs at other loop counts) is still read for the loops
figure, which groups by the file's own `model` and `settings.loops` fields.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from melt_eval.errors import UserError
from melt_eval.jsonio import read_json
from melt_eval.protocol.variants import EXIT_AWARE, FITTED_GATE
from melt_eval.report.paper import canonical_task

FITTED_SUFFIX = " (fitted gate)"  # an exit series on the gate the exit-gate recipe fitted (`ablate exit`'s fitted-gate rows)
EXIT_AWARE_SUFFIX = " (exit-aware, fitted gate)"  # ablate exit's exit-aware rows: the model fine-tuned for exits, its gate fitted


def split_fitted(label: str) -> tuple[str, str]:
    """An exit series' label -> (model, FITTED_SUFFIX or ""), so the model part can be displayed by its name."""
    return (label[: -len(FITTED_SUFFIX)], FITTED_SUFFIX) if label.endswith(FITTED_SUFFIX) else (label, "")


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


@dataclass
class ExitPoint:
    """One evaluation on the early-exit trade-off (beyond the paper): `rule` the run's --exit (None: full depth),
    `mean_loops` per generated token (results.json loops_per_token, else the run's T)."""

    rule: str | None
    mean_loops: float
    result: Result


def exit_points(rs: ResultSet) -> dict[tuple[str, str], list[ExitPoint]]:
    """Per (checkpoint, task) that has --exit runs: its points by mean loops per token, full depth included
    (the runs of the same checkpoint, task and T without --exit, sharing off)."""
    runs: dict[tuple, list[Result]] = {}
    for r in rs.every:
        s = r.settings
        # a compressed cache is another point (the frontier's), not this checkpoint's full depth
        if s.get("loops") and not s.get("kv_sharing") and not compressed_cache(r):
            runs.setdefault((r.raw.get("model_path") or r.model, r.task, s["loops"]), []).append(r)
    out = {}
    for (model, task, loops), members in runs.items():
        if not any(r.settings.get("exit") for r in members):
            continue
        points, seen = [], set()
        for r in members:
            rule = r.settings.get("exit")
            if rule in seen:  # the same evaluation copied under another name (an ablation reusing it)
                continue
            seen.add(rule)
            summary = r.raw.get("loops_per_token") or {}
            mean = summary.get("mean") if rule and isinstance(summary, dict) else None if rule else float(loops)
            if isinstance(mean, (int, float)) and not isinstance(mean, bool) and math.isfinite(mean) and mean > 0:
                points.append(ExitPoint(rule, float(mean), r))
        # `ablate exit` names each run by its rule (results/ablations/exit/<model>/<rule>/): the model is the folder
        # (the demo's exit/ouro-tiny/): that name first, over the shorter names of ablation rows sharing the checkpoint
        folders = {r.path.parents[2].name for r in members if len(r.path.parents) > 3 and r.path.parents[3].name == "exit"}
        label = min(folders or {r.model for r in members}, key=len)
        if all(r.path.parents[1].name.startswith(FITTED_GATE) for r in members):  # ablate exit's fitted-gate rows
            label += FITTED_SUFFIX
        elif all(r.path.parents[1].name.startswith(EXIT_AWARE) for r in members):  # its exit-aware rows
            label += EXIT_AWARE_SUFFIX
        out[(label, task)] = sorted(points, key=lambda p: p.mean_loops)
    return dict(sorted(out.items()))


def compressed_cache(r: Result) -> bool:
    """Evaluated with a compressed KV cache (--kv-cache-dtype other than auto, --cross-loop-kv)."""
    return r.settings.get("kv_cache_dtype", "auto") != "auto" or bool(r.settings.get("cross_loop_kv"))


class Malformed(ValueError):
    """A results.json that parses but does not hold what the contract says."""


def _schema():
    """The types docs/CONTRACTS.md "Results files" gives the fields the report reads (pydantic, strict: a
    list where a number belongs is refused, not coerced); other fields pass through. Metric values are
    checked by `_fraction` below (they may be a bare number or {"value", "stderr"})."""
    from typing import Annotated, Any, Optional

    from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

    # every number in range, as `run` writes it: NaN, Infinity or a loop count of 0 would reach the claims' figures
    Number = Optional[Annotated[float, Field(allow_inf_nan=False, ge=0)]]
    Count = Optional[Annotated[StrictInt, Field(ge=0)]]
    Positive = Optional[Annotated[StrictInt, Field(ge=1)]]

    class Settings(BaseModel):
        model_config = ConfigDict(extra="allow", strict=True)
        samples: Positive = None
        temperature: Number = None
        top_p: Optional[Annotated[float, Field(allow_inf_nan=False, gt=0, le=1)]] = None
        max_new_tokens: Positive = None
        seed: Count = None
        backend: Optional[StrictStr] = None
        loops: Positive = None
        kv_sharing: Optional[StrictStr] = None
        share_prompt: Optional[StrictBool] = None
        prefill_chunk: Positive = None
        max_problems: Count = None

    class Results(BaseModel):
        model_config = ConfigDict(extra="allow", strict=True)
        model: Optional[StrictStr] = None
        task: Optional[StrictStr] = None
        finished: StrictBool = True
        metrics: Optional[dict[str, Any]] = None
        settings: Optional[Settings] = None
        model_path: Optional[StrictStr] = None
        config_hash: Optional[StrictStr] = None
        wall_time_s: Number = None
        generated_tokens: Count = None
        peak_cache_bytes: Count = None
        num_problems: Count = None
        segments: Count = None
        cache_rows: Count = None
        analytic_cache_bytes: Count = None

    return Results


_SCHEMA = []
RANGE_ERRORS = {"finite_number", "greater_than", "greater_than_equal", "less_than", "less_than_equal"}  # pydantic's


def check_schema(raw: dict) -> None:
    """Malformed naming the first field of the wrong type (e.g. `settings.loops is a list, not an integer`)."""
    from pydantic import ValidationError

    if not _SCHEMA:
        _SCHEMA.append(_schema())
    try:
        _SCHEMA[0].model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "the file"
        got = first.get("input")
        # a number out of range is named by its value, a wrong type by its type
        said = repr(got) if first["type"] in RANGE_ERRORS else f"a {type(got).__name__}"
        raise Malformed(f"{where} is {said}: {first['msg'].lower()}") from None


def _fraction(value, what: str) -> float:
    """A metric value or stderr: a finite number in [0, 1] (LightEval's convention), else Malformed."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not 0 <= value <= 1:
        raise Malformed(f"{what} is {value!r}, not a fraction in [0, 1]")
    return float(value)


def _read(path: Path, task_dir: str) -> Result:
    raw = read_json(path, "a results.json")
    if not isinstance(raw, dict):
        raise Malformed(f"holds a {type(raw).__name__}, not a JSON object")
    check_schema(raw)
    metrics = {}
    raw_metrics = raw.get("metrics") or {}
    if not isinstance(raw_metrics, dict):
        raise Malformed("metrics is not an object")
    for name, m in raw_metrics.items():
        # each metric is read or refused: one dropped unread made its table cell and claim "not run"
        if isinstance(m, dict):
            stderr = None if m.get("stderr") is None else _fraction(m["stderr"], f"{name} stderr")
            metrics[name] = (_fraction(m.get("value"), name), stderr)
        else:
            metrics[name] = (_fraction(m, name), None)
    settings = raw.get("settings") or {}
    if not isinstance(settings, dict):
        raise Malformed("settings is not an object")
    finished = raw.get("finished", True)
    if not isinstance(finished, bool):  # "finished": "no" is not a yes
        raise Malformed(f"finished is {finished!r}, not true or false")
    return Result(
        path=path,
        model=str(raw.get("model") or path.parent.parent.name),
        task=canonical_task(task_dir) or task_dir,
        finished=finished,
        metrics=metrics,
        settings=settings,
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
        except UserError as exc:  # not UTF-8, not JSON, too deep, a directory: the message names the file
            rs.unreadable.append(str(exc))
            continue
        except (OSError, ValueError, TypeError, AttributeError) as exc:  # a results.json that says nonsense
            rs.unreadable.append(f"{path}: {exc if isinstance(exc, Malformed) else type(exc).__name__}; skipped")
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
