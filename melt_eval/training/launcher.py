"""`melt-eval train --nproc-per-node N`: the harness's own launch of several processes on this machine.

It checks what it can before any worker starts (`preflight`), starts the workers through PyTorch's elastic
launcher as `torchrun --standalone` would (`start_workers`), and turns a worker's refusal into one line, said once
(the workers hand it over in a file: launch.worker_refusal). torchrun and `accelerate launch` start the same
workers; there each rank says its own refusal.
"""

from __future__ import annotations

import os
from pathlib import Path

from melt_eval import float_path
from melt_eval.errors import UserError
from melt_eval.training.launch import (LAUNCH_ERRORS, NPROC_FLAG, THREADS, check_compile, check_fsdp,
                                       check_resume_world, launched_world)


class WorkerFailed(Exception):
    """A worker of `train --nproc-per-node` ended without a refusal (killed, crashed: its own output says how);
    `code` is the launch's exit code."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def worker_args(ctx) -> list[str]:
    """The `train` arguments as the user gave them (from the command's click context, whoever called it), less
    --nproc-per-node: what every worker runs."""
    def text(v) -> str:
        return os.fspath(v) if isinstance(v, os.PathLike) else str(v)

    args: list[str] = []
    for param in ctx.command.params:
        source = ctx.get_parameter_source(param.name)
        if param.name == "nproc_per_node" or source is None or source.name == "DEFAULT":
            continue
        value = ctx.params[param.name]
        if param.param_type_name == "argument":
            args += [text(v) for v in (value if param.multiple else [value])]
            continue
        long = [o for o in param.opts if o.startswith("--")][0]
        if getattr(param, "is_flag", False):
            off = [o for o in param.secondary_opts if o.startswith("--")]
            if value or off:
                args.append(long if value else off[0])
            continue
        for v in value if param.multiple else [value]:
            if v is not None:  # --opt=VALUE: a value starting with "-" stays a value
                args.append(f"{long}={text(v)}")
    return args


def preflight(nproc: int, recipe, output: Path, resume: bool) -> None:
    """What `train --nproc-per-node` checks before any worker starts, each a one-line UserError: the process count
    against the machine, a launcher already around it, the FSDP launch on CPUs, compile: captured, the output
    directory's lock, --resume (a run there, finished or not, with the same recipe) and the process count a
    checkpoint was written by. The workers check all of it again (a race is still refused, once)."""
    import torch

    from melt_eval.files import DirLock
    from melt_eval.training.checkpoints import read_trainer_state
    from melt_eval.training.run_files import prepare_output

    if nproc < 1:
        raise UserError(f"{NPROC_FLAG} must be at least 1, got {nproc}")
    if launched_world() > 1 or "LOCAL_RANK" in os.environ or "TORCHELASTIC_RUN_ID" in os.environ:
        raise UserError(f"{NPROC_FLAG} starts the processes itself: run `melt-eval train {NPROC_FLAG} N ...` on its "
                        f"own, not under torchrun or accelerate launch (or drop {NPROC_FLAG} there)")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus and nproc > gpus:
        raise UserError(f"{NPROC_FLAG} {nproc}: this machine has {gpus} GPU{'s' if gpus > 1 else ''}, one per "
                        f"process; pass at most {gpus}")
    if not gpus:
        from types import SimpleNamespace

        check_fsdp(SimpleNamespace(distributed_type="MULTI_CPU" if nproc > 1 else "NO"))
    check_compile(recipe, nproc)
    with DirLock(Path(output).expanduser().resolve(), "training run") as lock:  # released before the workers take it
        _, candidates, _ = prepare_output(lock.directory, recipe, resume, tidy=False)
        state = read_trainer_state(candidates[0]) if candidates else None
        if isinstance(state, dict):  # the checkpoint the workers load first
            check_resume_world(candidates[0], state.get("world_size", 1), nproc, recipe)


def start_workers(nproc: int, argv: list[str]) -> None:
    """`torchrun --standalone --nproc-per-node N -m melt_eval.cli train ARGV` through PyTorch's elastic launcher
    (torch.distributed.run's own configuration, no restarts). Workers get torchrun's OMP_NUM_THREADS (1 for
    several, unless the user set it). A refusal on any rank is one UserError here; a worker that died otherwise is
    WorkerFailed; Ctrl-C is a KeyboardInterrupt. The launcher's own log lines are silenced (the workers' output is
    theirs), and its files go to a folder under MELT_EVAL_HOME, removed afterwards."""
    import logging
    import signal
    import tempfile
    import uuid

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, get_args_parser

    from melt_eval import interrupts
    from melt_eval.registry import cache_home

    user = os.environ[THREADS] if float_path.set_by_user(THREADS) else None
    threads = user or ("1" if nproc > 1 else None)  # torchrun's rule; one process pins its own (float_path)
    saved_env = {k: os.environ.get(k) for k in (THREADS, LAUNCH_ERRORS)}
    # the launcher takes these signals over and leaves its handler behind
    saved_handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)}
    (cache_home() / "launch").mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="train-", dir=cache_home() / "launch") as folder:
        refusals = Path(folder) / "refusals"
        refusals.mkdir()
        args = get_args_parser().parse_args(["--standalone", f"{NPROC_FLAG}={nproc}", "--max-restarts=0",
                                             f"--log-dir={folder}/torchelastic", "-m", "melt_eval.cli", "train", *argv])
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())  # as run()
        os.environ[LAUNCH_ERRORS] = str(refusals)
        if threads is None:
            os.environ.pop(THREADS, None)
        else:
            os.environ[THREADS] = threads
        logging.disable(logging.CRITICAL)
        try:
            config, cmd, cmd_args = config_from_args(args)
            elastic_launch(config, cmd)(*cmd_args)
        except ChildFailedError as exc:
            said = sorted(refusals.glob("rank-[0-9]*[0-9]"))
            if said:  # every rank refuses alike: the lowest rank's line
                raise UserError(said[0].read_text(encoding="utf-8")) from None
            rank, failure = exc.get_first_failure()
            if failure.exitcode == 130:
                how, code = "was interrupted (Ctrl-C)", 130
            elif failure.exitcode < 0:
                how, code = f"was killed by {failure.signal_name()}", 1
            else:
                how, code = f"failed with exit code {failure.exitcode} (its output is above)", 1
            raise WorkerFailed(f"process {rank} of {nproc} {how}", code) from None
        except SignalException as exc:
            if exc.sigval == signal.SIGINT:
                interrupts.mark()
                raise KeyboardInterrupt from None
            raise WorkerFailed(f"stopped by {signal.Signals(exc.sigval).name}, and so were the workers",
                               128 + int(exc.sigval)) from None
        finally:
            logging.disable(logging.NOTSET)
            for sig, handler in saved_handlers.items():
                signal.signal(sig, handler)
            for key, value in saved_env.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
