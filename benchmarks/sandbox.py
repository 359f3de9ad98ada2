"""Cost of HumanEval's sandbox per check, against a bare child Python running the same program, one run.

    python benchmarks/sandbox.py [--checks 20] [--json]

Each check is a HumanEval-sized problem (a function and its asserts), run three ways that alternate, so a busy
machine slows all alike: a bare child Python; the whole program in the sandbox (`run_python`, the way checks
ran before issue 41, on the ctypes launcher); and how HumanEval scores now (`run_check`: the completion
sandboxed, `check` in a trusted checker, calls as data), on the launcher and on bubblewrap where `bwrap` is
installed. Report the ratios and the added milliseconds, not the absolute times.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time

import shutil
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _args import Parser, whole  # noqa: E402

from melt_eval.evaluation import sandbox  # noqa: E402
from melt_eval.evaluation.sandbox import SandboxLimits, describe, run_check, run_python  # noqa: E402

CODE = "def add(a, b):\n    return a + b\n"
TESTS = "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n"
PROGRAM = f"{CODE}\n{TESTS}\ncheck(add)\n"


def main() -> None:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--checks", type=whole(1), default=20)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    layers = describe()
    backends = ["launcher"] + (["bwrap"] if shutil.which("bwrap") else [])
    bare, sandboxed, checked = [], [], {name: [] for name in backends}
    for _ in range(args.checks):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-I", "-S", "-B", "-c", PROGRAM], check=True, stdin=subprocess.DEVNULL)
        bare.append(time.perf_counter() - start)
        sandbox.use_backend("launcher")
        start = time.perf_counter()
        assert run_python(PROGRAM, SandboxLimits()).passed
        sandboxed.append(time.perf_counter() - start)
        for name in backends:
            sandbox.use_backend(name)
            start = time.perf_counter()
            out = run_check(CODE, TESTS, "add", SandboxLimits())
            assert out.passed and out.layers["backend"] == name
            checked[name].append(time.perf_counter() - start)
    out = {
        "machine": platform.machine(), "cpus": os.cpu_count(), "load_avg_1m": os.getloadavg()[0],
        "checks": args.checks, "layers": {k: v for k, v in layers.items() if isinstance(v, bool)},
        "bare_python_ms": round(1000 * statistics.median(bare), 1),
        "sandboxed_ms": round(1000 * statistics.median(sandboxed), 1),
        "memory_bound": layers.get("memory_bound"),
    }
    out["ratio"] = round(out["sandboxed_ms"] / out["bare_python_ms"], 2)
    for name, times in checked.items():
        out[f"run_check_{name}_ms"] = round(1000 * statistics.median(times), 1)
        out[f"run_check_{name}_ratio"] = round(out[f"run_check_{name}_ms"] / out["bare_python_ms"], 2)
    if args.json:
        print(json.dumps(out))
        return
    for key, value in out.items():
        print(f"{key:>16}: {value}")


if __name__ == "__main__":
    main()
