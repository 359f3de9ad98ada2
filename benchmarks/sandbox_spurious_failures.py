"""How often a correct HumanEval completion that starts a thread and a child process fails in the sandbox, checked
back to back (optionally each after a fork bomb), per backend. Expected: never.

    python benchmarks/sandbox_spurious_failures.py [--checks 100] [--after-bomb] [--backend bwrap|launcher]

Measures the fault behind a flaky CI test (docs/results/2026-11-27-sandbox-process-limit.md): a process limit
that counted every process of the program's user on the host, so a previous check's processes, still being
reaped, made a legitimate `Thread.start()` or `os.fork()` fail with EAGAIN.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _args import Parser, whole  # noqa: E402

from melt_eval.evaluation import sandbox  # noqa: E402
from melt_eval.evaluation.sandbox import SandboxLimits, run_check  # noqa: E402

CORRECT = ("import os, threading\nt = threading.Thread(target=print)\nt.start()\nt.join()\nif os.fork() == 0:\n"
           "    os._exit(0)\nos.wait()\ndef add(a, b):\n    return a + b\n")
BOMB = "import os\nwhile True:\n    os.fork()\ndef add(a, b):\n    return a + b\n"
CHECK = "def check(candidate):\n    assert candidate(2, 3) == 5\n"


def main() -> None:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--checks", type=whole(1), default=100)
    parser.add_argument("--after-bomb", action="store_true", help="a fork bomb's check before each correct one")
    parser.add_argument("--backend", choices=["bwrap", "launcher"], default=None,
                        help="default: both (bwrap where installed)")
    args = parser.parse_args()
    if args.backend == "bwrap" and not shutil.which("bwrap"):
        parser.error("--backend bwrap: bubblewrap is not installed here; pass --backend launcher")
    backends = [args.backend] if args.backend else ["launcher"] + (["bwrap"] if shutil.which("bwrap") else [])
    out = {"checks": args.checks, "after_bomb": args.after_bomb, "load_start": os.getloadavg()}
    for name in backends:
        sandbox.use_backend(name)
        failures = []
        for i in range(args.checks):
            if args.after_bomb:
                run_check(BOMB, CHECK, "add", SandboxLimits())
            result = run_check(CORRECT, CHECK, "add", SandboxLimits())
            if not result.passed:
                failures.append({"check": i, "status": result.status,
                                 "error": (result.stderr.strip().splitlines() or [""])[-1]})
        out[name] = {"failed": len(failures), "first_failures": failures[:3]}
        print(f"{name}: {len(failures)} of {args.checks} correct completions failed", flush=True)
    out["load_end"] = os.getloadavg()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
