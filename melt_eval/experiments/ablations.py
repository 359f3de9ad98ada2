"""The paper's ablation tables as resumable plans (`melt-eval ablate`, and the demo's ablations).

A plan is a list of variants (`melt_eval.protocol.variants`); each is zero or more training runs
(phase 1, maybe phase 2) and one evaluation. Training runs are named by what they compute (recipe,
overrides, starting point), so a run two tables share is trained once: the gate table's
`elementwise` row, the component ladder's `no-align` row and phase 1 of its `full` row are the same
run, as in the paper. Finished runs are skipped, interrupted ones resume (through the training API,
`run_recipe`), and evaluations resume through `run_tasks`.

    runs/ablations/<run id>/                       checkpoints (RUNS)
    results/ablations/<ablation>/<variant>/<task>/  results.json (OUTPUT)
"""

from __future__ import annotations

import hashlib
import json
import shutil
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from melt_eval.errors import UserError
from melt_eval.protocol import variants as definitions
from melt_eval.training.config import ADDED_FIELDS, EXECUTION_FIELDS, compile_unused, load_recipe
from melt_eval.training.runs import FINISHED, INTERRUPTED, run_state, train_command

ABLATIONS = tuple(definitions.ABLATIONS)
BEYOND_PAPER = tuple(definitions.BEYOND_PAPER)  # `ablate exit`, `ablate kv-compression`: not the paper's rows, not in the demo's plan
# The models `ablate exit` sweeps, each evaluated as is (results/ablations/exit/<model>/<variant>/)
EXIT_MODELS = {"paper": ("ouro-1.4b-thinking", "melt-1.6b"), "tiny": ("tiny-random-ouro", "tiny-random-melt")}
PRESETS = {
    # recipes base, default base model, default tasks
    "paper": {"recipes": "paper", "base": "ouro-1.4b-thinking", "tasks": "ablation"},
    "tiny": {"recipes": "tiny", "base": "tiny-random-ouro", "tasks": "synthetic"},
}
# The paper's compute (appendix): a phase-1-only ablation run took 60 h on 8 H100s; the full
# two-phase MELT-1.6B run took 1,040 GPU-hours; evaluation was ~500 GPU-hours for everything.
PAPER_GPU_HOURS = {"phase1-only": 480, "full": 1040}


@dataclass
class TrainRun:
    phase: int
    recipe: str
    overrides: dict
    start: "str | TrainRun"  # a model name/path, or the run this one continues (phase 2)

    @property
    def run_id(self) -> str:
        """Readable, and a hash of everything the run computes: the resolved recipe and its start."""
        start = self.start.run_id if isinstance(self.start, TrainRun) else self.start
        resolved = load_recipe(self.recipe, overrides=dict(self.overrides)).to_dict()
        for name in EXECUTION_FIELDS:
            resolved.pop(name)
        for name, value in ADDED_FIELDS.items():
            if resolved[name] == value:
                resolved.pop(name)
        blob = json.dumps([resolved, start], sort_keys=True, default=str)
        readable = "-".join([self.recipe] + [f"{k}={v}" for k, v in sorted(self.overrides.items())])
        return f"{readable}-{hashlib.sha256(blob.encode()).hexdigest()[:8]}".replace("/", "_")


@dataclass
class VariantPlan:
    ablation: str
    name: str
    train: list[TrainRun] = field(default_factory=list)
    base: "str | TrainRun" = ""  # evaluated as is when there is no training
    eval_options: dict = field(default_factory=dict)

    @property
    def gpu_hours(self) -> str:
        if not self.train:
            return "eval only"
        if "phase" not in self.train[0].recipe:  # e.g. the exit-gate fit: no paper figure
            return "not in the paper"
        return f"{PAPER_GPU_HOURS['full' if len(self.train) == 2 else 'phase1-only']:,} GPU-h (paper)"


def plan(ablation: str, preset: str = "paper", base: "str | TrainRun | None" = None,
         train_overrides: dict | None = None, seed: int = 0) -> list[VariantPlan]:
    """The variants of one ablation; `train_overrides` (e.g. max_steps) apply to every training run.

    `seed` shifts every run's data order and gate initialisation (recipe seed + seed, gate_seed + seed),
    so a phase 2 keeps a data order other than its phase 1's; 0 leaves the recipes as they are.

    `base` is a model name or path, or the TrainRun that makes it (the demo's teacher): run ids then
    chain through run ids, not through however the caller spelled the base model's path.
    """
    if ablation not in ABLATIONS + BEYOND_PAPER:
        raise UserError(f"unknown ablation {ablation!r}; choose one of {', '.join(ABLATIONS + BEYOND_PAPER)}")
    if preset not in PRESETS:
        raise UserError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    if isinstance(base, str) and base:
        _check_base(base)
    if ablation == "exit":
        return exit_plan(preset, base, train_overrides)
    base = base or PRESETS[preset]["base"]
    recipes = PRESETS[preset]["recipes"]
    variants = []
    for name in definitions.RUN_ORDER[ablation]:
        defined = definitions.variant(ablation, name)
        runs: list[TrainRun] = []
        for phase, recipe, overrides in defined.training_steps(base=recipes):
            defaults = load_recipe(recipe).to_dict()
            seeded = {"seed": defaults["seed"] + seed, "gate_seed": defaults["gate_seed"] + seed} if seed else {}
            # an override equal to the recipe's own value is no change: dropping it lets equal runs share an id
            changed = {k: v for k, v in {**overrides, **(train_overrides or {}), **seeded}.items() if defaults.get(k) != v}
            runs.append(TrainRun(phase, recipe, changed, runs[-1] if runs else base))
        # with no training the base model is evaluated as is, with the variant's options
        variants.append(VariantPlan(ablation, name, train=runs, base="" if runs else base, eval_options=dict(defined.eval_options)))
    return variants


def _check_base(base: str) -> None:
    """--base checked locally (a directory, a registry name or a Hub id's form) before any run is planned on it."""
    from melt_eval.modeling.loading import parse_model_ref

    try:
        parse_model_ref(base)
    except UserError as exc:
        raise UserError(f"--base {base!r}: {exc}") from None


def exit_plan(preset: str = "paper", base: str | None = None, train_overrides: dict | None = None) -> list[VariantPlan]:
    """`ablate exit`: every exit rule of `definitions.EXIT` on each model (`base`, else the preset's Ouro and
    MELT), as is, and the fitted-gate rows on the gate the exit-gate recipe fits from that model (one run per
    model, `train_overrides` applied); a model's variants go to ablations/exit/<model>/<variant>/."""
    plans = []
    for model in [base] if base else EXIT_MODELS[preset]:
        label = Path(str(model).rstrip("/")).name or str(model)
        for name in definitions.RUN_ORDER["exit"]:
            if name.startswith(definitions.EXIT_AWARE) and not melt_with_teacher(model):
                continue  # exit-aware training continues a MELT with its own KD: its teacher must be on record
            defined = definitions.variant("exit", name)
            runs = chained_runs(defined, PRESETS[preset]["recipes"], model, train_overrides)
            plans.append(VariantPlan(f"exit/{label}", name, train=runs, base="" if runs else model,
                                     eval_options=dict(defined.eval_options)))
    return plans


def chained_runs(defined, recipes: str, start: "str | TrainRun", extra: dict | None) -> list[TrainRun]:
    """A beyond-the-paper variant's training runs on the "paper" or "tiny" `recipes`: each run starts from the one
    before (a chain: exit-aware training, then its gate fit), the first from `start`; `extra` overrides each."""
    runs: list[TrainRun] = []
    for phase, recipe, overrides in defined.training_steps(recipes):
        changed = {**overrides, **(extra or {})}
        if changed.get("compile") and compile_unused(load_recipe(recipe, overrides={**changed, "compile": False}),
                                                     changed["compile"]):
            # the demo's --compile reaches a run that cannot compile (a gate fit, exit-aware training at chunk 1):
            # it runs eager, as it always did, and its record says so (compile is not in a run's id)
            del changed["compile"]
        runs.append(TrainRun(phase, recipe, changed, runs[-1] if runs else start))
    return runs


def melt_with_teacher(model: "str | TrainRun") -> bool:
    """A MELT that recorded its teacher: a MELT run of this plan, or a MELT checkpoint directory whose training
    record names one (registry models such as melt-1.6b record none: `ablate exit` leaves the exit-aware rows out)."""
    if isinstance(model, TrainRun):
        return load_recipe(model.recipe).target == "melt"
    from melt_eval.modeling.loading import checkpoint_model_type
    from melt_eval.training.build import recorded_teacher

    path = Path(str(model))
    return (path / "config.json").is_file() and checkpoint_model_type(path) == "melt" and recorded_teacher(path) is not None


def _train_command(run: TrainRun, runs_dir: Path) -> str:
    start = runs_dir / run.start.run_id if isinstance(run.start, TrainRun) else run.start
    # the paper-sized recipes are run on many GPUs with the FSDP config; the tiny ones in one process
    return train_command(run.recipe, start, runs_dir / run.run_id, run.overrides, fsdp=run.recipe.startswith("paper"))


def _eval_model(variant: VariantPlan, runs_dir: Path) -> str:
    made_by = variant.train[-1] if variant.train else variant.base
    return str(runs_dir / made_by.run_id) if isinstance(made_by, TrainRun) else made_by


def _eval_command(variant: VariantPlan, runs_dir: Path, output: Path, tasks: str, backend: str) -> str:
    opts = variant.eval_options
    flags = [f"--kv-sharing {opts['kv_sharing']}"] if opts.get("kv_sharing") else []
    flags += ["--share-prompt"] if opts.get("share_prompt") else []
    flags += [f"--exit {opts['exit']}"] if opts.get("exit") else []
    flags += [f"--kv-cache-dtype {opts['kv_cache_dtype']}"] if opts.get("kv_cache_dtype", "auto") != "auto" else []
    flags += ["--cross-loop-kv"] if opts.get("cross_loop_kv") else []
    return " ".join([f"melt-eval run {tasks} --model {_eval_model(variant, runs_dir)} --backend {backend}",
                     f"--name {variant.name} --output {output / 'ablations' / variant.ablation}", *flags])


def describe(variants: list[VariantPlan], runs_dir: Path, output: Path, tasks: str, backend: str) -> list[dict]:
    """Every step the plan would run, with its command and the paper's GPU-hours (for --dry-run)."""
    steps, seen = [], set()
    for v in variants:
        for run in v.train:
            status = "shared" if run.run_id in seen else _train_status(runs_dir / run.run_id)
            seen.add(run.run_id)
            steps.append({"ablation": v.ablation, "variant": v.name, "step": f"train phase {run.phase}", "status": status,
                          "command": _train_command(run, runs_dir), "paper_gpu_hours": v.gpu_hours})
        steps.append({"ablation": v.ablation, "variant": v.name, "step": "evaluate", "status": "",
                      "command": _eval_command(v, runs_dir, output, tasks, backend),
                      "paper_gpu_hours": "part of ~500 GPU-h (all evaluation)"})
    return steps


def _train_status(run_dir: Path) -> str:
    return {FINISHED: "done", INTERRUPTED: "resume"}.get(run_state(run_dir), "to do")


def train_run(run: TrainRun, runs_dir: Path, progress: bool = True) -> Path:
    """Train one run unless it has finished; resume it if it was interrupted. Returns runs_dir/<run id>,
    spelled as runs_dir is, whether it trained now or earlier."""
    from melt_eval.training import run_recipe

    out = runs_dir / run.run_id
    status = _train_status(out)
    if status == "done":
        return out
    start = train_run(run.start, runs_dir, progress) if isinstance(run.start, TrainRun) else run.start
    if progress:
        print(f"training {run.run_id} ({'resuming' if status == 'resume' else 'from ' + Path(str(start)).name})", flush=True)
    run_recipe(run.recipe, str(start), out, overrides=dict(run.overrides), resume=status == "resume", progress=progress,
               label=run.run_id.rsplit("-", 1)[0])
    return out


def usable_cores() -> int:
    """The cores this process may run on (its affinity, where the platform says)."""
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def check_jobs(jobs: int | None) -> None:
    """Refuse (UserError) more side-by-side jobs than cores: each is a one-thread process loading its own torch, so
    more of them only share the cores, and a typo's hundreds would exhaust the memory."""
    cores = usable_cores()
    if jobs is not None and jobs > cores:
        raise UserError(f"--jobs {jobs} is more than the {cores} core{'s' if cores > 1 else ''} this process may use "
                        f"(each job is a one-thread process); pass --jobs {cores} or fewer")


def train_runs(runs: list[TrainRun], runs_dir: Path, jobs: int = 1, progress: bool = True) -> None:
    """Train every run not finished yet, `jobs` at a time, a run after the one it continues from.

    Side by side, each run is a spawned process with one torch thread: a tiny model's chunk-wise step is
    thousands of small operations that a second thread barely speeds up, so two one-thread runs finish
    sooner than the same two runs one after the other with two threads
    (docs/results/2026-11-26-benchmarks.md#runs-side-by-side). A failed run stops the others from
    starting; those already running finish (and stay resumable)."""
    train_and_evaluate(runs, [], "", runs_dir, jobs=jobs, progress=progress)


def train_and_evaluate(runs: list[TrainRun], evaluations: list["Evaluation"], tasks: str, runs_dir: Path, *,
                       jobs: int = 1, backend: str = "native", progress: bool = True, **eval_kwargs) -> list[dict]:
    """Train every run, then evaluate every evaluation (see `evaluate_all`); with `jobs` > 1 on a CPU, as
    one queue of one-thread worker processes: an evaluation starts as soon as the run that makes its model
    has finished, while other runs still train, so no core waits at the end of training for the slowest
    run. Training runs start first (a phase 2 as soon as its phase 1 is done, `start_order`), evaluations
    take the cores no startable run needs. The results are the same either way (every run and every
    sample is seeded)."""
    pending: dict[str, TrainRun] = {}
    for run in runs:
        if _train_status(runs_dir / run.run_id) != "done":
            pending.setdefault(run.run_id, run)
    todo = _evaluations_to_run(evaluations, tasks)
    if jobs > 1 and todo and (backend != "native" or _cuda()):  # one process owns the accelerator: evaluate after
        train_and_evaluate(runs, [], "", runs_dir, jobs=jobs, progress=progress)
        return evaluate_all(evaluations, tasks, jobs=1, backend=backend, progress=progress, **eval_kwargs)
    queue = [_Job(run_id, (train_run, run, runs_dir, progress),
                  {run.start.run_id} & set(pending) if isinstance(run.start, TrainRun) else set())
             for run_id, run in start_order(pending, {run.run_id for run in runs})]
    made_by = {str(runs_dir / run_id): run_id for run_id in pending}
    queue += [_Job(f"evaluate {e.results_dir}", (_evaluate, e, tasks, backend, progress, eval_kwargs),
                   {made_by[str(e.model)]} if str(e.model) in made_by else set()) for e in todo]
    if jobs > 1 and len(queue) > 1:
        _run_side_by_side(queue, jobs)
    else:
        with job_threads(backend):
            for run in pending.values():
                train_run(run, runs_dir, progress)
    # the evaluations left to do run here, one after another; finished ones are read back
    return evaluate_all(evaluations, tasks, jobs=1, backend=backend, progress=progress, **eval_kwargs)


@dataclass
class _Job:
    key: str
    call: tuple  # (function, *arguments), picklable
    after: set  # keys of the jobs it needs finished first


def _run_side_by_side(queue: list[_Job], workers: int) -> None:
    """Run the queue in `workers` spawned one-thread processes, each job once those it needs have finished,
    the first startable one in queue order first. A failure stops further starts; the jobs already running
    finish (a training run stays resumable); then it propagates."""
    import multiprocessing
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

    pending = {job.key: job for job in queue}
    done: set = set()
    running: dict = {}  # future -> job key
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"), initializer=_side_by_side) as pool:
        while pending or running:
            for key, job in list(pending.items()):
                if len(running) < workers and job.after <= done:
                    running[pool.submit(*job.call)] = key
                    del pending[key]
            if not running:
                raise RuntimeError(f"jobs wait for jobs that are not queued: {sorted(pending)}")
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in finished:
                done.add(running.pop(future))
                future.result()


def start_order(pending: dict[str, TrainRun], batch: set[str]) -> list[tuple[str, TrainRun]]:
    """Pending runs in the order to start them: one that continues another run of the batch first (a
    phase 2 ends the longest chain, so a core left to it late is the costliest wait), then as listed."""
    def continues_one(run: TrainRun) -> bool:
        return isinstance(run.start, TrainRun) and run.start.run_id in batch

    return sorted(pending.items(), key=lambda item: not continues_one(item[1]))


JOB_THREADS = 1  # a queued job's torch threads, side by side or one after another (`job_threads`)


@contextmanager
def job_threads(backend: str = "native"):
    """A queued job computes with JOB_THREADS torch threads here too, as it does in a side-by-side worker: the
    thread count splits reductions, so a job run one after another at the process's count logged other last bits
    (gate means, phase 2's alignment) than the same job side by side, and a run's records depended on the number
    of cores (docs/results/2026-12-07-demo-five-seeds-pinned.md). Left alone where no CPU computes the job (CUDA)
    or another engine owns its threads (vLLM)."""
    import torch

    if backend != "native" or _cuda() or torch.get_num_threads() == JOB_THREADS:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(JOB_THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _side_by_side() -> None:
    """A worker process of `_run_side_by_side`: one torch thread, and progress as plain lines (no bars to tangle)."""
    import os

    import torch

    from melt_eval.progress import PLAIN_ENV

    os.environ[PLAIN_ENV] = "1"
    torch.set_num_threads(JOB_THREADS)


@dataclass(frozen=True)
class Evaluation:
    """`model` evaluated into `results_dir` under `name`, with the inference options that set it apart
    (kv_sharing, share_prompt, loops); the options every evaluation shares are `evaluate_all`'s."""

    model: str
    results_dir: Path
    name: str
    options: dict = field(default_factory=dict)

    @property
    def key(self) -> tuple[str, str]:
        """Equal keys compute equal results: options left at their defaults (None/False) are left out."""
        return str(self.model), json.dumps({k: v for k, v in self.options.items() if v}, sort_keys=True)


def variant_evaluations(variants: list[VariantPlan], runs_dir: Path, output: Path) -> list[Evaluation]:
    """Each variant's evaluation: results/ablations/<ablation>/<variant>/."""
    return [Evaluation(_eval_model(v, runs_dir), output / "ablations" / v.ablation / v.name, v.name, dict(v.eval_options))
            for v in variants]


def evaluate_all(evaluations: list[Evaluation], tasks: str, *, jobs: int = 1, backend: str = "native",
                 progress: bool = True, **eval_kwargs) -> list[dict]:
    """Every evaluation, each (model, options) generated once: a second evaluation of the same checkpoint
    with the same options gets a copy of the first one's results under its own name.

    With `jobs` > 1 on a CPU (native backend), the evaluations left to do run side by side, each in a
    spawned process with one torch thread, as training's runs do; the results are the same (every
    sample is seeded by its problem). A failure propagates once the running ones finish."""
    first = first_of_each(evaluations)
    todo = _evaluations_to_run(evaluations, tasks) if jobs > 1 and backend == "native" and not _cuda() else []
    if len(todo) > 1:
        _run_side_by_side([_Job(str(e.results_dir), (_evaluate, e, tasks, backend, progress, eval_kwargs), set())
                           for e in todo], min(jobs, len(todo)))
    results = []
    with job_threads(backend):
        for e in evaluations:
            if first[e.key] is not e:
                _copy_results(first[e.key].results_dir, e.results_dir, e.name, tasks)
            results += _evaluate(e, tasks, backend, progress, eval_kwargs)  # a finished task is read back, not re-run
    return results


def first_of_each(evaluations: list[Evaluation]) -> dict[tuple[str, str], Evaluation]:
    """The first evaluation of each (model, options) by key: the one that generates; later ones get copies."""
    first: dict[tuple[str, str], Evaluation] = {}
    for e in evaluations:
        first.setdefault(e.key, e)
    return first


def _evaluations_to_run(evaluations: list[Evaluation], tasks: str) -> list[Evaluation]:
    """The first evaluation of each (model, options) whose results are not finished."""
    return [e for e in first_of_each(evaluations).values() if not _finished(e.results_dir, tasks)]


def _evaluate(e: Evaluation, tasks: str, backend: str, progress: bool, eval_kwargs: dict) -> list[dict]:
    from melt_eval.evaluation import BackendSettings, RunPaths, run_tasks
    from melt_eval.generation.options import InferenceOptions

    flags = {**e.options, **eval_kwargs}
    # one chunk rule for every row (exact MELT, as before), not each checkpoint's training rule (run's default):
    # the rows compare how models were trained, and results evaluated so far resume
    flags.setdefault("prefill_chunk", 1)
    max_problems = flags.pop("max_problems", None)
    return run_tasks(tasks, e.model, InferenceOptions.from_flags(**flags), RunPaths(results_dir=e.results_dir, name=e.name),
                     backend=BackendSettings(kind=backend), max_problems=max_problems, progress=progress)


def _finished(results_dir: Path, tasks: str) -> bool:
    """Every task's results.json says finished (run_tasks still checks that its settings match)."""
    from melt_eval.evaluation.runner import read_finished
    from melt_eval.protocol.tasks import expand

    # read_finished reads none, a damaged one, or one that is no regular file (a FIFO blocked the read) as None
    return all(read_finished(results_dir / task) is not None for task in expand(tasks))


def _copy_results(src: Path, dst: Path, name: str, tasks: str) -> None:
    from melt_eval.protocol.tasks import expand
    from melt_eval.files import write_json_atomic

    for task in expand(tasks):
        if (src / task / "results.json").exists() and not (dst / task).exists():
            shutil.copytree(src / task, dst / task)
            data = json.loads((dst / task / "results.json").read_text())
            data["model"] = name
            write_json_atomic(dst / task / "results.json", data)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def run_variants(variants: list[VariantPlan], *, runs_dir: Path, output: Path, tasks: str, backend: str = "native",
                 eval_kwargs: dict | None = None, progress: bool = True, jobs: int = 1) -> list[dict]:
    """Train every variant and evaluate each, `jobs` at a time (see `train_and_evaluate`)."""
    return train_and_evaluate([run for v in variants for run in v.train], variant_evaluations(variants, runs_dir, output),
                              tasks, runs_dir, jobs=jobs, backend=backend, progress=progress, **(eval_kwargs or {}))
