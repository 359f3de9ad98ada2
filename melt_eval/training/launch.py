"""Several processes: what the launcher started, what the run records of it, and the work only rank 0 does.

The same `melt-eval train` runs as one process or as N ranks (torchrun, `accelerate launch`;
docs/training.md#several-processes). Three things make N ranks one run:

- Accelerate builds a process group on CPUs only when told `cpu=True`: without it, every torchrun rank on
  a machine without GPUs believes it is alone (`accelerator_kwargs`).
- What must happen once per run (take the output directory's lock, check it against --resume) happens on
  rank 0; the other ranks wait at the run's barrier for its outcome, an error included (`on_main`), so
  a refused run stops on every rank instead of leaving ranks waiting for a peer that exited.
- The run records its layout (`layout`) and says in one line when it is not what was asked: fewer ranks
  than the launcher was asked for (`launch_problem`), a token batch the layout cannot reach (`batch_note`).

`melt-eval train --nproc-per-node N` is the harness's own launch (launcher.py); its workers hand a refusal over to
it in a file (`worker_refusal`), so that it is said once.
"""

from __future__ import annotations

import os
from pathlib import Path

from melt_eval.errors import UserError

WORLD_ENV = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")
LAUNCH_ERRORS = "MELT_EVAL_LAUNCH_ERRORS"  # set by `train --nproc-per-node` for its workers: where a refusal goes
THREADS = "OMP_NUM_THREADS"
NPROC_FLAG = "--nproc-per-node"
CAPTURED_WITH_SEVERAL = ("compile: captured adds the weights' gradients into .grad itself, which DDP and FSDP "
                         "cannot reduce: set compile: true to compile a launch of several processes")


def launched_world() -> int:
    """The number of ranks the launcher says it started (1 when no launcher set one)."""
    for name in WORLD_ENV:
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 1


def accelerator_kwargs() -> dict:
    """What `PartialState`/`Accelerator` need here: `cpu=True` for several ranks on a machine without GPUs
    (Accelerate then joins them in a gloo process group, MULTI_CPU)."""
    import torch

    return {"cpu": True} if launched_world() > 1 and not torch.cuda.is_available() else {}


def on_main(state, fn, *args):
    """fn(*args) on the main process only; every rank returns its result (or raises its UserError),
    the other ranks having waited for it. One process: just fn(*args)."""
    if state.num_processes == 1:
        return fn(*args)
    from accelerate.utils import broadcast_object_list

    outcome = [None]
    if state.is_main_process:
        try:
            outcome = [("ok", fn(*args))]
        except UserError as exc:
            outcome = [("error", str(exc))]
        except BaseException as exc:  # the other ranks must not wait for a peer that is gone
            outcome = [("error", f"rank 0 failed ({type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''})")]
            broadcast_object_list(outcome)
            raise
    broadcast_object_list(outcome)
    kind, value = outcome[0]
    if kind == "error":
        raise UserError(value)
    return value


def check_fsdp(state) -> None:
    """A launch that asks for FSDP (`accelerate launch` with melt_eval/recipes/accelerate/fsdp.yaml exports
    ACCELERATE_USE_FSDP) runs FSDP or stops: Accelerate selects FSDP only on accelerators, and on CPUs it would
    silently train plain data parallel (MULTI_CPU) with every rank holding the whole optimiser state.
    `state`: the PartialState (its MULTI_GPU-like types become FSDP once the Accelerator is made; NO and
    MULTI_CPU never do) or the Accelerator's state (FSDP, or refused)."""
    asked = os.environ.get("ACCELERATE_USE_FSDP", "").lower() in ("1", "true", "yes")
    ran = str(state.distributed_type).split(".")[-1]
    final = type(state).__name__ == "AcceleratorState"
    if asked and (ran != "FSDP" if final else ran in ("NO", "MULTI_CPU")):
        raise UserError(f"the launch asks for FSDP but Accelerate set up {ran} here (it runs FSDP on GPUs only); "
                        "on CPUs drop the FSDP config and launch with `melt-eval train --nproc-per-node N ...` "
                        "(docs/training.md#several-processes)")


def launch_problem(state) -> str | None:
    """One line when the launcher was asked for more ranks than joined this run, else None."""
    asked = launched_world()
    if asked > state.num_processes:
        return (f"the launcher started {asked} processes (WORLD_SIZE) but {state.num_processes} joined this run; "
                "check the launch command (docs/training.md#several-processes)")
    use_cpu = os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes")
    if state.num_processes == 1 and use_cpu and "MASTER_ADDR" in os.environ and asked == 1:
        # `accelerate launch --cpu --num_processes N` (N > 1) sets MASTER_ADDR but starts one process:
        # Accelerate's CPU launcher starts several only under mpirun (--mpirun_hostfile)
        return ("accelerate launch --cpu started one process, not the --num_processes asked (Accelerate starts several "
                "CPU processes only under mpirun); run `melt-eval train --nproc-per-node N ...` or "
                "`accelerate launch --multi_gpu --num_processes N -m melt_eval.cli train ...` (docs/training.md#several-processes)")
    return None


def layout(state, recipe, accum: int) -> dict:
    """What the run records of how it is spread: ranks, Accelerate's distributed type, the per-rank
    micro-batch and accumulation, and the sequence slots and tokens they add up to per optimiser step."""
    sequences = state.num_processes * recipe.micro_batch_size * accum
    return {"world_size": state.num_processes, "distributed_type": str(state.distributed_type).split(".")[-1],
            "micro_batch_size": recipe.micro_batch_size, "grad_accum_steps": accum,
            "global_sequences_per_step": sequences, "global_tokens_per_step": sequences * recipe.seq_len,
            "batch_tokens": recipe.batch_tokens}


def describe(lay: dict) -> str:
    """The layout as the run's first log line."""
    return (f"layout: {lay['world_size']} process{'es' if lay['world_size'] > 1 else ''} ({lay['distributed_type']}), "
            f"micro-batch {lay['micro_batch_size']} x accumulation {lay['grad_accum_steps']} per process = "
            f"{lay['global_sequences_per_step']} sequences, {lay['global_tokens_per_step']:,} token slots per step")


def batch_note(lay: dict, seq_len: int) -> str | None:
    """One line saying what to set when processes x micro-batch x accumulation x seq_len misses batch_tokens."""
    if lay["global_tokens_per_step"] == lay["batch_tokens"]:
        return None
    world, micro = lay["world_size"], lay["micro_batch_size"]
    wanted = lay["batch_tokens"] / seq_len
    head = (f"batch_tokens {lay['batch_tokens']:,} is not reached: {world} processes x micro-batch {micro} x accumulation "
            f"{lay['grad_accum_steps']} x seq_len {seq_len} = {lay['global_tokens_per_step']:,} token slots per step; ")
    if not wanted.is_integer():
        return head + f"set batch_tokens to a multiple of seq_len ({seq_len})"
    wanted = int(wanted)
    if wanted % world:
        fits = [n for n in range(1, wanted + 1) if wanted % n == 0]
        return head + f"run a number of processes that divides {wanted} sequences ({', '.join(map(str, fits[:8]))})"
    per_rank = wanted // world
    micros = [m for m in range(1, per_rank + 1) if per_rank % m == 0]
    return head + (f"set micro_batch_size to one of {', '.join(map(str, micros[:8]))} "
                   f"({per_rank} sequences per process)")


def announce_layout(accelerator, recipe) -> dict:
    """The run's first log line (its layout); a warning on stderr when fewer ranks joined than were launched, a
    note after the layout when it misses batch_tokens (tiny test layouts do, on purpose: stdout keeps stderr for
    errors). Returns the layout with those lines (`warnings`), for the run's record."""
    import sys

    check_fsdp(accelerator.state)
    lay = layout(accelerator.state, recipe, recipe.grad_accum_steps(accelerator.num_processes))
    problem, note = launch_problem(accelerator.state), batch_note(lay, recipe.seq_len)
    accelerator.print(describe(lay))
    if note:
        accelerator.print(f"note: {note}")
    if problem and accelerator.is_main_process:
        print(f"warning: {problem}", file=sys.stderr, flush=True)
    return {**lay, "warnings": [line for line in (problem, note) if line]}


def check_resume_world(ckpt, saved: int, world: int, recipe) -> None:
    """A checkpoint from `saved` processes resumes on `world` when a step still sees the same global batch: the
    data position is the global stream's, the model and optimiser states are whole (Accelerate saves them from rank
    0), and a step draws no random numbers of its own. Otherwise one line naming both."""
    def sequences(n: int) -> int:
        return n * recipe.micro_batch_size * recipe.grad_accum_steps(n)

    if saved != world and sequences(saved) != sequences(world):
        raise UserError(f"--resume: {ckpt.name} was written by {saved} process{'es' if saved > 1 else ''} "
                        f"({sequences(saved)} sequences per step) and this run has {world} ({sequences(world)} per step); "
                        f"resume it with {saved} process{'es' if saved > 1 else ''} (melt-eval train --nproc-per-node {saved} ...)")


def check_compile(recipe, world: int) -> None:
    """compile: captured trains one process only (`prepare_student` applies it; target exit_gate compiles nothing)."""
    if recipe.compile == "captured" and world > 1 and recipe.target != "exit_gate":
        raise UserError(CAPTURED_WITH_SEVERAL)


def worker_refusal(message: str) -> bool:
    """In a worker of `train --nproc-per-node`: hand the one-line refusal to the launch, which says it once for all
    ranks; True when handed over (the worker then exits 2 without printing it), False elsewhere."""
    folder = os.environ.get(LAUNCH_ERRORS)
    if not folder:
        return False
    try:
        path = Path(folder) / f"rank-{int(os.environ.get('RANK', '0')):06d}"
        part = path.with_name(path.name + ".part")
        part.write_text(message, encoding="utf-8")
        os.replace(part, path)  # the launch reads whole messages only
    except (OSError, ValueError):
        return False
    return True


def peer_refused() -> bool:
    """In a worker of `train --nproc-per-node`: whether a rank has refused (and left: the error a peer then meets
    at the next collective is no news; the launch says the refusal)."""
    folder = os.environ.get(LAUNCH_ERRORS)
    return bool(folder) and any(Path(folder).glob("rank-[0-9]*[0-9]"))


def launch_worker() -> bool:
    """Whether this process is a worker of `train --nproc-per-node` (the launch speaks for it)."""
    return bool(os.environ.get(LAUNCH_ERRORS))
