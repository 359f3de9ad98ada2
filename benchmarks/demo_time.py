"""The demo's wall time against a reference commit's, the two run one after the other on one machine (issue 51,
item 5: the demo stays within the 15 minutes of the demo that issue timed).

A demo's wall time belongs to the machine as much as to the code: shared 2-core machines differ from one another,
and from one hour to the next, by more than a change to the code does. What carries from one machine to another
is the ratio of two codes timed back to back on one of them. This runs the full `melt-eval demo`
(`--no-progress`, its default jobs and threads) at the current checkout and at REF, each with this interpreter,
REF in a git worktree made for the run and removed after, and reports the ratio; with `--reference-wall`, what
the ratio makes of the current code's time on the machine where REF's demo took that long.

    python benchmarks/demo_time.py --out /tmp/demo-time [--ref 7111383] [--seed 0] [--order current-first]
        [--reference-wall 874]

7111383 is the code issue 51 timed at 874 s (14 min 34 s). Each run's record is written as it ends
(OUT/<label>.json); a second call skips a recorded run and starts an unrecorded one afresh (a demo resumed from
its cache would not be timed). A record is used only if it timed the same demo (seed, --quick) at the same commit
(HEAD for the current run, REF for the other). Writes OUT/demo_time.json and prints one summary; exit 1 if a demo
failed (its output is in OUT/<label>.log), 2 on bad arguments or an unusable record, before any demo runs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from _args import Parser  # noqa: E402  (benchmarks/: the script's own folder)

REPO = Path(__file__).resolve().parents[1]
LABELS = {"current-first": ("current", "ref"), "ref-first": ("ref", "current")}
MAX_SEED = 2**32 - 1  # the demo's seeds are numpy's
# a record's wall_s is rounded to 0.1 s; a denormal or a huge time would make the ratio 0 or inf
MIN_WALL, MAX_WALL = 0.1, 1e7


class Refused(Exception):
    """Bad arguments or a saved record that cannot be used: one line, exit 2."""


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), *args], check=True, capture_output=True, text=True).stdout.strip()


def resolve(ref: str) -> str | None:
    """REF's full commit id; None if it names no commit of this repository."""
    try:
        return git("rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}")
    except subprocess.CalledProcessError:
        return None


def refuse(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def time_demo(checkout: Path, commit: str, out: Path, label: str, seed: int, quick: bool = False) -> dict:
    """One full demo from `checkout` into OUT/demo-<label>, timed from outside; its demo.json's headline beside."""
    demo_dir = out / f"demo-{label}"
    shutil.rmtree(demo_dir, ignore_errors=True)  # a cached stage would be reused, not timed
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # the demo picks its threads itself
    env["PYTHONPATH"] = str(checkout)  # this checkout's melt_eval, not the installed one
    # what ran, read before it runs (an edit during the run is not what was timed)
    record = {"label": label, "seed": seed, "quick": quick, "commit": commit}
    if label == "current":
        record["uncommitted_changes"] = bool(git("status", "--porcelain", "--untracked-files=no"))
    load_start = os.getloadavg()
    started = time.perf_counter()
    with open(out / f"{label}.log", "w") as log:
        command = [sys.executable, "-m", "melt_eval.cli", "demo", "--output", str(demo_dir), "--no-progress",
                   "--seed", str(seed), *(["--quick"] if quick else [])]
        rc = subprocess.run(command, cwd=checkout, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - started
    record.update(returncode=rc, wall_s=round(wall, 1), load_average={"start": [round(x, 2) for x in load_start],
                                                                     "end": [round(x, 2) for x in os.getloadavg()]})
    demo_json = demo_dir / "demo.json"
    if rc == 0 and demo_json.exists():
        demo = json.loads(demo_json.read_text())
        record.update({k: demo.get(k) for k in ("stages_s", "teacher_pass@1", "melt_pass@1", "claims_hold")})
        record["teacher_stopped_at"] = (demo.get("teacher_stop") or {}).get("stopped_at")  # None: a fixed step count
    return record


def load_record(saved: Path, label: str, commit: str, seed: int, quick: bool) -> dict:
    """A run's saved record, if it timed this demo (seed, --quick) at this commit with a usable time; else Refused
    (a record of other code or another demo would put another ratio in the summary)."""
    again = f"delete it to time the {label} run again, or pass another --out"
    try:
        record = json.loads(saved.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise Refused(f"{saved} is not a readable record ({type(e).__name__}); {again}") from None
    wall = record.get("wall_s") if isinstance(record, dict) else None
    if not _seconds(wall):  # the file's values are quoted as JSON spells them (true, not True)
        raise Refused(f"{saved} holds no wall time in seconds from {MIN_WALL} to {MAX_WALL:g} "
                      f"(wall_s {json.dumps(wall)}); {again}")
    # exact types: true == 1 and 1.0 == 1 would pass a record of another demo
    if type(record.get("seed")) is not int or type(record.get("quick")) is not bool or \
            (record["seed"], record["quick"]) != (seed, quick):
        raise Refused(f"{saved} timed another demo (seed {json.dumps(record.get('seed'))}, "
                      f"quick {json.dumps(record.get('quick'))}); pass another --out")
    if record.get("commit") != commit:
        raise Refused(f"{saved} timed commit {str(record.get('commit'))[:12]}, not {commit[:12]}; {again}")
    return record


def _seconds(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
        and MIN_WALL <= value <= MAX_WALL


def summarize(records: dict[str, dict], reference_wall: float | None) -> dict:
    """The ratio current / ref of the two wall times and, given REF's time on another machine, the current code's
    estimate there (the ratio times it)."""
    ratio = records["current"]["wall_s"] / records["ref"]["wall_s"]
    out = {"ratio": round(ratio, 3)}
    if reference_wall is not None:
        out["reference_wall_s"] = reference_wall
        out["estimate_s"] = round(ratio * reference_wall, 1)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = Parser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="a directory for the two demos, their logs and the records")
    ap.add_argument("--ref", default="7111383", help="the commit to time against (default: the code issue 51 timed)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--order", choices=sorted(LABELS), default="current-first")
    ap.add_argument("--quick", action="store_true", help="the demo's --quick: checks this script, times nothing of interest")
    ap.add_argument("--reference-wall", type=float, default=None, metavar="SECONDS",
                    help="REF's demo wall time on another machine, to estimate the current code's there")
    a = ap.parse_args(argv)
    try:
        return run(a)
    except Refused as e:
        return refuse(str(e))


def run(a: argparse.Namespace) -> int:
    if not 0 <= a.seed <= MAX_SEED:
        raise Refused(f"--seed is a seed of the demo's, 0 to {MAX_SEED}")
    if a.reference_wall is not None and not _seconds(a.reference_wall):
        raise Refused(f"--reference-wall is a time in seconds, from {MIN_WALL} to {MAX_WALL:g}")
    if not a.out.strip():  # Path("") is the working directory
        raise Refused("--out is empty; pass a directory for the demos and their records")
    a.out = Path(a.out).resolve()  # the demos run from their checkouts: a relative --out would land inside them
    ref = resolve(a.ref)
    if ref is None:
        raise Refused(f"{a.ref!r} is not a commit of {REPO}; pass --ref a commit id or tag")
    try:
        a.out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise Refused(f"cannot make --out {a.out}: {e.strerror or e}; pass a directory you can write") from None
    commits = {"current": git("rev-parse", "HEAD"), "ref": ref}
    # every saved record checked before any demo runs: a bad second record would waste the first demo's time
    records = {label: load_record(a.out / f"{label}.json", label, commits[label], a.seed, a.quick)
               for label in LABELS[a.order] if (a.out / f"{label}.json").exists()}
    worktree = a.out / f"ref-{ref[:12]}"
    try:
        for label in LABELS[a.order]:
            saved = a.out / f"{label}.json"
            if label in records:
                continue
            checkout = REPO
            if label == "ref":
                if not worktree.exists():
                    git("worktree", "add", "--detach", str(worktree), ref)
                checkout = worktree
            print(f"[demo-time] {label} ({'the checkout' if label == 'current' else ref[:12]}): started at load "
                  f"{os.getloadavg()[0]:.2f}", flush=True)
            records[label] = time_demo(checkout, commits[label], a.out, label, a.seed, a.quick)
            if records[label]["returncode"] != 0:
                print(f"[demo-time] {label}: the demo failed (exit {records[label]['returncode']}); "
                      f"see {a.out / (label + '.log')}", file=sys.stderr)
                return 1
            saved.write_text(json.dumps(records[label], indent=1, allow_nan=False) + "\n")
            print(f"[demo-time] {label}: {records[label]['wall_s']:.0f} s", flush=True)
    finally:
        if worktree.exists():
            git("worktree", "remove", "--force", str(worktree))
    result = {"order": a.order, "seed": a.seed, "quick": a.quick, "runs": records, **summarize(records, a.reference_wall)}
    (a.out / "demo_time.json").write_text(json.dumps(result, indent=1, allow_nan=False) + "\n")
    line = (f"current {records['current']['wall_s']:.0f} s, ref {records['ref']['wall_s']:.0f} s: "
            f"ratio {result['ratio']:.3f}")
    if "estimate_s" in result:
        line += f"; where ref took {a.reference_wall:.0f} s, the current code would take about {result['estimate_s']:.0f} s"
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
