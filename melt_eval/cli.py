"""`melt-eval` command line.

Each area of the harness owns its commands in a command module with `register(app)`, so this file
stays a table of contents: the model registry (`models`), evaluation (`run`, `score`, `tasks`), vLLM
serving (`serve`), training (`train`), the report (`report`, `memory`) and the experiments (`ablate`,
`demo`). Library modules never import typer; only these command modules do.

Starting is light: command modules import what their commands need inside the commands, so
`melt-eval --help`, `melt-eval tasks` and `melt-eval models` load neither torch nor transformers
(tests/test_imports.py). This file, at the top, is also where the report's `memory --measure vllm` is
wired to the vLLM backend, so the report never imports a backend.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
import threading

from melt_eval import compile_cache, float_path, interrupts  # none imports torch
from melt_eval.training.launch import launch_worker, peer_refused, worker_refusal  # nor does this

# Before anything loads torch: the kernels, MKL branch and thread count every command computes with, inherited by
# every process it starts (melt_eval/float_path.py).
float_path.pin()
compile_cache.pin()  # Inductor's cache under MELT_EVAL_HOME, not /tmp (melt_eval/compile_cache.py)


def _interrupted_while_starting(signum, frame) -> None:
    """Ctrl-C while the command modules load (seconds on a busy machine): one line, exit 130, no traceback
    (SystemExit leaves an import quietly; nothing has been done yet)."""
    interrupts.mark()  # should an import swallow the SystemExit, main() still stops before the command runs
    sys.stderr.write("interrupted: melt-eval was starting; nothing was done\n")
    sys.exit(130)


_in_main_thread = threading.current_thread() is threading.main_thread()  # only there can a handler be set
_previous = signal.signal(signal.SIGINT, _interrupted_while_starting) if _in_main_thread else None

import typer  # noqa: E402  (after the handler: Ctrl-C during these imports is one line too)

from melt_eval.errors import UserError

# The command modules, in the order `melt-eval --help` lists their commands.
COMMAND_MODULES = (
    "melt_eval.modeling.cli",
    "melt_eval.evaluation.cli",
    "melt_eval.serve",
    "melt_eval.training.cli",
    "melt_eval.report.cli",
    "melt_eval.experiments.cli",
)
def vllm_measure_kv():
    """`memory --measure vllm`'s measurement: the vLLM backend's `measure_kv`, imported on use (vLLM is optional)."""
    from melt_eval.generation.vllm_backend import measure_kv

    return measure_kv


# The commands whose numbers depend on the float path: where it cannot be the published one, they say so first.
COMPUTING = ("train", "run", "score", "demo", "ablate")

# What a command module is given besides the app: the parts of other layers its commands call.
WIRING = {"melt_eval.report.cli": {"load_measure_kv": vllm_measure_kv}}


app = typer.Typer(
    name="melt-eval",
    help="Train, ablate and evaluate MELT (Memory-Efficient Looped Transformer) and its baselines.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _root() -> None:
    """Train, ablate and evaluate MELT and its baselines."""


for _name in COMMAND_MODULES:
    importlib.import_module(_name).register(app, **WIRING.get(_name, {}))
if _in_main_thread:
    signal.signal(signal.SIGINT, _previous if _previous is not None else signal.default_int_handler)


def main() -> None:
    """Console entry point: user errors become one line on stderr and exit code 2; Ctrl-C is one line and
    exit 130 wherever it lands (melt_eval/interrupts.py)."""
    if interrupts.requested():  # Ctrl-C at start-up whose SystemExit an import swallowed; its line is written
        sys.exit(130)
    interrupts.install()
    if bad_switch := float_path.switch_error():  # before any command computes on a float path it did not ask for
        typer.secho(f"error: {bad_switch}", fg=typer.colors.RED, err=True)
        sys.exit(2)
    command = next((a for a in sys.argv[1:] if not a.startswith("-")), None)
    launching = any(a.split("=")[0] == "--nproc-per-node" for a in sys.argv[1:])  # its rank 0 says it, as it applies there
    # a worker of `train --nproc-per-node` says it once its run has passed its checks (runner._train): its refusal
    # (another writer took the directory between the launch's check and the workers) stays one line
    if (command in COMPUTING and os.environ.get("RANK", "0") == "0" and not launching and not launch_worker()
            and (line := float_path.notice())):  # once per launch
        typer.secho(line, fg=typer.colors.YELLOW, err=True)
    try:
        app()
    except UserError as exc:
        if not worker_refusal(str(exc)):  # a worker of `train --nproc-per-node`: the launch says it, once
            typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        sys.exit(2)
    except (KeyboardInterrupt, Exception) as exc:  # while typer builds the commands, or an error after Ctrl-C
        if not interrupts.is_interrupt(exc):
            if peer_refused():  # a worker whose peer refused and left: the launch says why, once
                sys.exit(2)
            raise
        lost = "" if isinstance(exc, KeyboardInterrupt) else f" ({type(exc).__name__} on the way out)"
        _say_interrupted(f"stopped at Ctrl-C{lost}")
    except SystemExit as exc:  # typer's silent exit 130 for a KeyboardInterrupt no command caught
        if exc.code != 130 or not interrupts.requested() or interrupts.reported():
            raise
        _say_interrupted("stopped at Ctrl-C")


def _say_interrupted(what: str) -> None:
    typer.secho(f"interrupted: {what}", fg=typer.colors.YELLOW, err=True)
    interrupts.handled()
    sys.exit(130)


if __name__ == "__main__":
    main()
