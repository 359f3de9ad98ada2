"""LightEval's own output files, written beside the harness's in a task's results directory.

    <task_dir>/results_<date>.json                                      LightEval's results file
    <task_dir>/details/<model>/<date>/details_<task>|0_<date>.parquet   LightEval's details (one row per problem;
                                                                        the prompt is model_response.input)
    <task_dir>/samples_<task>_<date>.jsonl                              lm-evaluation-harness-style samples
                                                                        (only with log_samples)

The first two are written by LightEval 0.13 itself: `Pipeline.save_and_push_results` calls
`EvaluationTracker.save`, built with `output_dir=<task_dir>` and `results_path_template="{output_dir}"`
(so the results file sits beside results.json; the details keep the tracker's own
`details/<model>/<date>/` layout, which LightEval's `load_details_datasets` reads back). `<date>` is
LightEval's: the local time of saving, ISO 8601 with ":" written "-". Only results.json is read by
`melt-eval report`; these files are for LightEval's (and lm-evaluation-harness's) tools.
"""

from __future__ import annotations

import hashlib
import json
from contextlib import suppress
from datetime import datetime, timezone
from pathlib import Path


def tracker_settings(task_dir: Path | None, workdir: Path) -> dict:
    """EvaluationTracker arguments that put LightEval's files in `task_dir`; with None, a tracker that saves
    nothing (`melt-eval score`), its directory `workdir`."""
    if task_dir is None:
        return {"output_dir": str(workdir), "save_details": False}
    return {"output_dir": str(task_dir), "results_path_template": "{output_dir}", "save_details": True}


def save_lighteval(pipeline, task_dir: Path, sampling=None) -> tuple[dict, str | None]:
    """LightEval saves its results and details (its own `save_and_push_results`); returns the files it
    wrote, relative to `task_dir` ({"results": path, "details": [paths]}), and the date in their names.
    `sampling` (the run's `Sampling`) goes into the results' model_config.generation_parameters."""
    import datasets
    from lighteval.models.model_input import GenerationParameters

    if sampling is not None:  # the model's config says LightEval's defaults (temperature 0) otherwise
        pipeline.evaluation_tracker.general_config_logger.model_config.generation_parameters = GenerationParameters(
            temperature=sampling.temperature, top_p=sampling.top_p, max_new_tokens=sampling.max_new_tokens, seed=sampling.seed)
    before = set(task_dir.glob("results_*.json"))
    existing = _tree(task_dir / "details")
    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bar()  # "Creating parquet from Arrow format" per task
    try:
        pipeline.save_and_push_results()
    except OSError as exc:  # a full disk mid-parquet (pyarrow's errors are OSErrors): no cut file stays behind
        for path in sorted((set(task_dir.glob("results_*.json")) - before) | (_tree(task_dir / "details") - existing),
                           key=lambda p: len(p.parts), reverse=True):  # files, then their new folders, deepest first
            with suppress(OSError):
                path.rmdir() if path.is_dir() else path.unlink()
        from melt_eval.files import write_failed

        raise write_failed(exc, getattr(exc, "filename", None) or task_dir,
                           "LightEval's partial files were removed; the finished problems are kept in completions.jsonl "
                           "and the run resumes from them") from None
    finally:
        if bars:
            datasets.enable_progress_bar()
    new = sorted(set(task_dir.glob("results_*.json")) - before)
    if not new:
        return {}, None
    results = new[-1]
    date_id = results.stem[len("results_"):]
    model = pipeline.evaluation_tracker.general_config_logger.model_name.strip("/")
    details = sorted((task_dir / "details" / model / date_id).glob(f"details_*_{date_id}.parquet"))
    return {"results": results.relative_to(task_dir).as_posix(),
            "details": [p.relative_to(task_dir).as_posix() for p in details]}, date_id


def _tree(root: Path) -> set[Path]:
    """`root` and every file and folder under it (none when it does not exist)."""
    return {root, *root.rglob("*")} if root.is_dir() else set()


def finish_stamp() -> tuple[str, str]:
    """The time now, as results.json's "date" (ISO 8601, UTC) and as a file name's date (":" as "-")."""
    now = datetime.now(timezone.utc)
    return now.isoformat(timespec="seconds").replace("+00:00", "Z"), now.replace(tzinfo=None).isoformat().replace(":", "-")


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def write_samples(task_dir: Path, task: str, date_id: str, details: list[dict], rows: list[dict], sampling) -> str:
    """`samples_<task>_<date>.jsonl` in lm-evaluation-harness's layout (one line per problem: doc_id, doc,
    target, arguments, resps, filtered_resps, filter, metrics, the three hashes and each metric's
    value); returns its name. `details`: the harness's details.jsonl rows; `sampling`: the run's `Sampling`,
    written as the request's generation kwargs."""
    generation = {"do_sample": sampling.temperature > 0, "temperature": sampling.temperature, "top_p": sampling.top_p,
                  "max_gen_toks": sampling.max_new_tokens, "seed": sampling.seed, "repeats": sampling.samples}
    by_position = {r.get("_position", i): r for i, r in enumerate(rows)}
    lines = []
    for d in details:
        doc = {k: v for k, v in by_position.get(d["index"], {}).items() if k != "_position"}
        prompt, target = d.get("prompt") or "", str(d["gold"])
        line = {
            "doc_id": d["index"], "doc": doc, "target": target,
            "arguments": {"gen_args_0": {"arg_0": prompt, "arg_1": generation}},
            "resps": [[c["text"] for c in d["completions"]]],
            "filtered_resps": [[c["extracted"] for c in d["completions"]]],
            "filter": "none", "metrics": sorted(d["metrics"]),
            "doc_hash": _sha(json.dumps(doc, indent=2, default=str, ensure_ascii=False)),
            "prompt_hash": _sha(prompt), "target_hash": _sha(target),
            **d["metrics"],
        }
        lines.append(json.dumps(line, default=str, ensure_ascii=False) + "\n")
    name = f"samples_{task}_{date_id}.jsonl"
    from melt_eval.files import write_text_atomic

    write_text_atomic(task_dir / name, "".join(lines))
    return name
