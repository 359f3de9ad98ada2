"""Ctrl-C, remembered, so that every Ctrl-C ends `melt-eval` with one line and exit 130.

Python turns SIGINT into a KeyboardInterrupt wherever the main thread happens to be, and three things can
then go wrong:
- library code loses it: C code that clears any error it meets, or an import cut between loading a
  submodule and binding it to its parent (numpy.dtypes left in sys.modules but not on numpy makes the
  next `np.dtypes` recurse until RecursionError), so the run goes on or fails later with another error;
- typer ends a KeyboardInterrupt that no command caught (while it parses the arguments, say) with exit
  130 and no word;
- CPython (3.11) marks a KeyboardInterrupt that ends string-evaluated code (the `exec` inside dataclasses,
  namedtuple, typing) as unhandled even when it is caught, and under `python -m` then exits by SIGINT
  instead of with the code it was given (Modules/main.c: pymain_run_module, Py_RunMain).
So the command line's handler records each Ctrl-C: a command's interrupt handling takes any error after
it for the interrupt, the training loop checks it between steps, and `melt_eval.cli.main` says the one
line no command said.

Only `melt_eval.cli.main` installs the handler; importing the library changes no signal handling.
"""

from __future__ import annotations

import signal
import threading

_requested = False  # Ctrl-C was pressed
_reported = False  # a command has said what it left


def _remember_and_raise(signum, frame) -> None:
    mark()
    raise KeyboardInterrupt


def install() -> None:
    """SIGINT -> recorded, then KeyboardInterrupt (the main thread only: only there can a handler be set)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _remember_and_raise)


def mark() -> None:
    """Record a Ctrl-C that was handled elsewhere (the command line's start-up handler)."""
    global _requested
    _requested = True


def requested() -> bool:
    """Whether Ctrl-C has been pressed in this process (under `install`)."""
    return _requested


def reported() -> bool:
    return _reported


def is_interrupt(exc: BaseException) -> bool:
    """A KeyboardInterrupt, or any error raised after Ctrl-C was pressed (an interrupt a library lost)."""
    return isinstance(exc, KeyboardInterrupt) or (isinstance(exc, Exception) and _requested)


def check() -> None:
    """Raise the KeyboardInterrupt a library swallowed, at a point where stopping is clean (between steps)."""
    if _requested:
        raise KeyboardInterrupt


def handled() -> None:
    """A command has written its one line and is about to exit 130."""
    global _reported
    _reported = True
    eval("None")  # clears CPython's unhandled-KeyboardInterrupt mark (above): the exit code stays 130
