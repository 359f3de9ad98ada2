"""Start-up time of the light commands: the code before the import restructuring (issue 37) vs this tree.

    python benchmarks/cli_start.py --before /tmp/before [--before-ref REF] [--runs 7] [--keep-page-cache]

`--before` is a checkout of the earlier code (made with `git worktree add --detach DIR REF` when it is
missing and `--before-ref` is given); each command runs as the console script runs it (`from
melt_eval.cli import main; main()`), in a fresh interpreter with PYTHONPATH pointing at one tree or the
other, from an empty directory. Per tree and command: cold (the first run, after dropping the page cache
where this user may: `sync; echo 3 > /proc/sys/vm/drop_caches`; otherwise only the first run) and warm
(the median of the next runs), plus whether torch was loaded. The load average is printed before and after.
"""

from __future__ import annotations

import ast
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from _args import Parser, whole  # noqa: E402

COMMANDS = (["--help"], ["tasks"], ["models", "--format", "json"])
HEAVY = ("torch", "transformers", "lighteval", "vllm")
PROBE = (
    "import sys\n"
    "from melt_eval.cli import main\n"
    "sys.argv = ['melt-eval', *sys.argv[1:]]\n"
    "try:\n"
    "    main()\n"
    "except SystemExit:\n"
    "    pass\n"
    "import melt_eval\n"
    f"print('PROBE', melt_eval.__file__, sorted(m for m in {HEAVY!r} if m in sys.modules), file=sys.stderr)\n"
)


def drop_caches() -> bool:
    """Empty the page cache (root with a writable /proc/sys only); True if it was dropped."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def once(tree: Path, argv: list[str], cwd: str) -> tuple[float, str, list[str]]:
    """(wall seconds, the melt_eval file that ran, heavy modules loaded) of one start."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    started = time.perf_counter()
    run = subprocess.run([sys.executable, "-c", PROBE, *argv], cwd=cwd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    line = next((x for x in run.stderr.splitlines() if x.startswith("PROBE ")), None)
    if run.returncode != 0 or line is None:
        raise SystemExit(f"melt-eval {' '.join(argv)} failed in {tree}:\n{run.stderr[-2000:]}")
    _, file, heavy = line.split(" ", 2)
    return wall, file, ast.literal_eval(heavy)


def load() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main() -> None:
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, default=Path("/tmp/before"), help="checkout of the earlier code")
    parser.add_argument("--before-ref", help="git ref to check out into --before when it is missing")
    parser.add_argument("--runs", type=whole(1), default=7, help="runs per tree and command (the first is the cold one)")
    parser.add_argument("--keep-page-cache", action="store_true",
                        help="never drop the page cache (it slows whatever else runs on the machine)")
    args = parser.parse_args()
    if not (args.before / "melt_eval").is_dir():
        if not args.before_ref:
            parser.error(f"{args.before} has no melt_eval/: pass --before a checkout, or --before-ref to check one out there")
        if args.before.exists():
            parser.error(f"{args.before} exists without melt_eval/; pass a new --before for the checkout of {args.before_ref}")
        ref = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--verify", "--quiet", f"{args.before_ref}^{{commit}}"],
                             capture_output=True, text=True)
        if ref.returncode != 0:
            parser.error(f"--before-ref {args.before_ref!r} is not a commit of {REPO}")
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(args.before), args.before_ref],
                       check=True)
    trees = {"before": args.before.resolve(), "after": REPO}
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs; {args.runs} runs per tree and command")
    print("load before:", load())
    rows = []
    with tempfile.TemporaryDirectory() as cwd:
        for argv in COMMANDS:
            for label, tree in trees.items():
                dropped = False if args.keep_page_cache else drop_caches()
                times, heavy_seen = [], set()
                for _ in range(args.runs):
                    wall, file, heavy = once(tree, argv, cwd)
                    assert Path(file).resolve().is_relative_to(tree), f"{file} is not from {tree}"
                    times.append(wall)
                    heavy_seen.update(heavy)
                rows.append((" ".join(argv), label, times[0], dropped, statistics.median(times[1:] or times),
                             min(times[1:] or times), sorted(heavy_seen)))
    print("load after: ", load())
    print()
    print(f"{'command':<31} {'code':<7} {'cold s':>7} {'(cache)':<9} {'warm s':>7} {'min s':>6}  heavy modules loaded")
    for command, label, cold, dropped, warm, best, heavy in rows:
        print(f"{'melt-eval ' + command:<31} {label:<7} {cold:7.2f} {'dropped' if dropped else 'kept':<9} {warm:7.2f} "
              f"{best:6.2f}  {', '.join(heavy) or '-'}")


if __name__ == "__main__":
    main()
