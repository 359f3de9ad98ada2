"""Host memory a HumanEval check holds as a whole (launcher, program, its children and the trusted checker) while
a completion attacks the checker, per backend and per memory bound, against the check's documented bound.

    python benchmarks/checker_memory.py [--bound-mib 384] [--max-processes 6]

The attack is issue 52's: the completion forks a child that holds memory inside the check, and its function
answers with one line of nested empty lists just under 16 MiB, which a checker that parses whatever it is sent
turns into hundreds of MiB. The peak is the sum of the proportional anonymous and shared-memory set sizes
(PSS) of every process of the check, sampled every 20 ms, each sample with the check's processes stopped.
For the before/after ratio, run it in one command with PYTHONPATH on a copy of the package whose sandbox.py
and sandbox_launcher.py are the earlier commit's.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _args import Parser, whole  # noqa: E402

from melt_eval.evaluation import sandbox  # noqa: E402
from melt_eval.evaluation.sandbox import SandboxLimits, run_check  # noqa: E402

ATTACK = """
import os, time
if os.fork() == 0:
    held = []
    try:
        for _ in range(40):
            held.append(bytes([len(held) + 1]) * (8 << 20))
    except MemoryError:
        pass
    time.sleep(6)
    os._exit(0)
time.sleep(1)
def add(a, b):
    line = b'{"v": [' + b'[],' * ((16 << 20) // 3 - 8) + b'[]]}\\n'
    view = memoryview(line)
    while view:
        view = view[os.write(3, view):]
    return 0
"""
CHECK = "def check(candidate):\n    assert candidate(2, 3) == 5\n"


def _check_processes() -> dict[int, tuple[int, bytes]]:
    """The check's processes now, as pid: (parent, cmdline): this process's descendants that run the sandbox's
    launcher or its runner (the program, its forks, the checker); not bwrap, nor a fork yet to exec."""
    parents, cmdlines = {}, {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue  # exited between the listing and the reads: both or neither are kept
        parents[int(pid)], cmdlines[int(pid)] = parent, cmdline
    mine = {os.getpid()}
    for _ in range(6):  # launcher, init, program, its children
        mine |= {pid for pid, parent in parents.items() if parent in mine}
    return {pid: (parents[pid], cmdlines[pid]) for pid in mine - {os.getpid()}
            if b"evaluation/sandbox_launcher.py" in cmdlines[pid] or b"_melt_eval_runner" in cmdlines[pid]}


def _wait_until_stopped(pids: list[int], timeout_s: float = 2.0) -> None:
    """SIGSTOP is delivered when the process next runs: wait until each is stopped, a zombie or gone."""
    deadline = time.monotonic() + timeout_s
    for pid in pids:
        while time.monotonic() < deadline:
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                break
            if state in "TtZX":
                break
            time.sleep(0.0005)


def check_pss() -> tuple[int, int, list]:
    """(all the check's processes, the trusted checker alone, each process as (pid, parent, MiB)): the PSS of
    their anonymous and shared-memory pages, bytes. Not the host's cached libraries, which every Python maps
    and a cgroup charges to whoever read them first.

    One instant's: the processes are stopped while they are read and go on after. Read one by one while they
    ran, a child the OOM killer freed was counted beside the memory another child took in its place (a sum
    over the bound that was never held at once)."""
    stopped: list[int] = []
    try:
        while True:  # until no process forked by one not yet stopped is left running
            processes = _check_processes()
            new = [pid for pid in processes if pid not in stopped]
            if not new:
                break
            for pid in new:
                try:
                    os.kill(pid, signal.SIGSTOP)
                except ProcessLookupError:
                    continue
                stopped.append(pid)
            _wait_until_stopped(new)
        total = checker = 0
        parts = []
        for pid, (parent, cmdline) in processes.items():
            try:
                rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
            except OSError:
                continue
            pss = sum(int(line.split()[1]) << 10 for line in rollup.splitlines()
                      if line.startswith(("Pss_Anon:", "Pss_Shmem:")))
            total += pss
            parts.append((pid, parent, pss >> 20))
            if b"--check" in cmdline:
                checker += pss
        return total, checker, parts
    finally:
        for pid in stopped:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass


def measure(limits: SandboxLimits) -> dict:
    peak, done, failed = [0, 0], threading.Event(), []

    def watch():
        try:
            while not done.is_set():
                total, checker, _ = check_pss()
                peak[0], peak[1] = max(peak[0], total), max(peak[1], checker)
                time.sleep(0.02)
        except BaseException as exc:  # noqa: BLE001 - said after the check: a dead sampler measured nothing since
            failed.append(exc)

    watcher = threading.Thread(target=watch)
    watcher.start()
    start = time.monotonic()
    try:
        result = run_check(ATTACK, CHECK, "add", limits)
    finally:
        done.set()
        watcher.join()
    if failed:
        raise RuntimeError(f"the memory sampler died ({failed[0]!r}): the peak was not measured") from failed[0]
    return {"peak_mib": peak[0] >> 20, "checker_peak_mib": peak[1] >> 20, "passed": result.passed,
            "memory_bound": result.layers.get("memory_bound"), "wall_s": round(time.monotonic() - start, 2),
            "checker_said": (result.check_output.strip().splitlines() or [""])[-1][:120]}


def main() -> None:
    parser = Parser(description=__doc__.splitlines()[0])
    # the attack holds up to 320 MiB and answers 16 MiB: a bound far below that measures only the refusal
    parser.add_argument("--bound-mib", type=whole(64, 1 << 20), default=384)
    parser.add_argument("--max-processes", type=whole(2, 4096), default=6, help="the attack forks one child")
    args = parser.parse_args()
    limits = SandboxLimits(timeout_s=20, memory_bytes=args.bound_mib << 20, max_processes=args.max_processes)
    backends = ["launcher"] + (["bwrap"] if shutil.which("bwrap") else [])
    bounds = (["cgroup"] if sandbox._memory_cgroup_parent() is not None else []) + ["address_space_budget"]
    out = {"bound_mib": args.bound_mib, "load_start": os.getloadavg(), "runs": []}
    real_cgroup = sandbox._new_cgroup
    for name in backends:
        sandbox.use_backend(name)
        for bound in bounds:
            sandbox._new_cgroup = real_cgroup if bound == "cgroup" else (lambda memory_bytes: None)
            out["runs"].append({"backend": name, "bound": bound, **measure(limits)})
    sandbox._new_cgroup = real_cgroup
    out["load_end"] = os.getloadavg()
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
