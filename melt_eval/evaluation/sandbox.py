"""Run untrusted Python (HumanEval completions) contained by the kernel, never in the harness process.

Two backends build the same containment (`backend()`): bubblewrap where `bwrap` is installed and works
(`sandbox_launcher._bwrap`: bwrap runs as `nobody`, makes the namespaces and the read-only root below, and
installs a seccomp filter passed in with `--seccomp`, which leaves exec, prctl and seccomp to the runner's
own whole filter), else the built-in launcher, which is also the fallback when bwrap cannot set up. The
filter stays the hand-assembled one: no maintained libseccomp binding is installable with pip (pyseccomp's
last release is from 2021; the official binding ships only with distributions' Pythons).

Per check on the launcher (the child side is `sandbox_launcher.py`):

* the harness (`run_python`) writes the program into a throw-away directory, starts the launcher and,
  when the launcher made a user namespace, writes its uid/gid maps (only a process outside may map
  `nobody`);
* the launcher (trusted, stdlib only, dies with the harness) unshares a user, PID, mount, network, IPC
  and UTS namespace and pivot_roots into a new root: a read-only 16 MiB tmpfs holding read-only binds of
  the system paths Python needs (/usr, /lib*, /bin, /sbin, the interpreter's prefix), the program's
  directory (/sandbox, read-only), a fresh 16 MiB /tmp and /dev/{null,zero,full,random,urandom}. No
  /proc, no host Unix sockets, no results directory, no other host file;
* an init, PID 1 of the new PID namespace, becomes `nobody` (harness as root; else the user, with no
  capability left), dies with the launcher, reaps and keeps the wall-clock deadline. When it exits the
  kernel kills everything left in the namespace, so nothing the program started (setsid or not)
  outlives the check;
* the program's process takes the rlimits (CPU, address space, open files, file size, no core) and execs
  Python, whose first code (`_RUNNER`) takes the process limit (inside the check's user namespace, where it
  counts this check's processes and no other of its user's on the host) and installs a seccomp filter refusing
  execve, socket of every family, namespace-making clone/unshare/setns, mount, ptrace, prctl, bpf,
  io_uring and the like, then runs the program.

Memory is bounded per check as a whole: the harness makes a memory cgroup for each check where it can (v1
`memory`, or v2 with memory delegated) and moves the launcher into it before anything forks, so all the
check's processes, its tmpfs pages and pipes count together; `run_check`'s trusted checker joins the same
cgroup before it reads its token (the harness writes the token only then). Where it cannot, the address-space
limit is the check's budget divided by `max_processes` (RLIMIT_NPROC counts them), plus one share for the
checker (`sandbox_launcher.share_bytes`). The checker bounds what it parses: no answer over `ANSWER_BYTES` or
nested deeper than `ANSWER_DEPTH`, both checked before `json.loads`. Memory no address-space limit sees is
refused (memfd_create, memfd_secret and SysV shmget by seccomp, POSIX message queues by RLIMIT_MSGQUEUE), and
RLIMIT_NOFILE bounds open files and so pipe buffers. Temp directories and cgroups carry the harness's pid; a
check removes those whose harness is dead (kill -9 runs no cleanup).

`run_python` passes a program that ran to its end: the runner then writes a token the harness drew at random
for this check to a pipe (the token comes on stdin, read and closed before the program starts, so
`sys.exit(0)`, `os._exit(0)`, atexit tricks, kills and timeouts fail). The runner's frame still holds it
while the program runs, so code that reads the interpreter's frames can copy it: fine for running a program,
not for scoring one. HumanEval therefore uses `run_check`: the completion alone runs in the sandbox (no token
there), and the problem's `check` runs in a separate trusted checker process (`sandbox_launcher._check`)
that holds the token and calls the completion's function through pipes, arguments and results as tagged
JSON of builtin literals (`CODEC`), so no frame, object or forged `__eq__` crosses.

Where the kernel refuses a layer, `run_python` raises `SandboxUnavailable` (a one-line UserError) naming
it, unless `allow_unsafe_local_exec(True)` was called (`--unsafe-local-exec`): then it runs with the
layers it got and `SandboxResult.layers` says which.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from melt_eval.errors import UserError
from melt_eval.evaluation import sandbox_launcher
from melt_eval.evaluation.sandbox_launcher import LAYERS, NOBODY, SYSCALLS, seccomp_filter  # noqa: F401 (API)


class SandboxUnavailable(UserError):
    """The kernel refused a containment layer (and --unsafe-local-exec was not given)."""


@dataclass
class SandboxLimits:
    timeout_s: float = 10.0  # wall clock
    cpu_s: int = 10
    memory_bytes: int = 1 << 30  # the whole check: a memory cgroup, else an address-space budget (see _run)
    max_processes: int = 16  # threads included, counted in the sandbox's own user namespace
    max_open_files: int = 64  # per process (RLIMIT_NOFILE): bounds pipe buffers too
    max_file_bytes: int = 1 << 20  # largest file the program may write (stdout included)
    output_bytes: int = 4096  # how much of stdout/stderr is read back


@dataclass
class SandboxResult:
    passed: bool  # the program ran to its end (the runner's token came back) within the limits
    status: str  # "passed" | "failed" | "timeout" | "killed"
    returncode: int | None
    stdout: str
    stderr: str
    wall_s: float
    layers: dict = field(default_factory=dict)  # containment layers that were active
    check_output: str = ""  # run_check: the trusted checker's output (the failed assertion's traceback)


_unsafe = False


def allow_unsafe_local_exec(allow: bool) -> None:
    """`--unsafe-local-exec`: run programs with whatever layers the kernel grants instead of refusing."""
    global _unsafe
    _unsafe = bool(allow)


def _interpreter() -> tuple[str, str]:
    """(python for the program, its prefix to bind). The harness's own interpreter when `nobody` can read it."""
    exe, prefix = os.path.realpath(sys.executable), os.path.realpath(sys.base_prefix)
    lib = Path(prefix) / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
    if os.geteuid() != 0 or (lib.is_dir() and all(os.stat(p).st_mode & 0o005 == 0o005 for p in (exe, prefix, lib))):
        return exe, prefix
    return os.path.realpath("/usr/bin/python3"), "/usr"


def _host_interpreter() -> str:
    """Without a mount namespace (unsafe only) the program sees the host: a python `nobody` can reach."""
    candidates = [os.path.realpath(sys.executable), "/usr/bin/python3", "/usr/local/bin/python3"]
    if os.geteuid() != 0:
        return candidates[0]
    for cand in candidates:
        path = Path(os.path.realpath(cand))
        if path.exists() and all(p.stat().st_mode & 0o001 for p in [path, *path.parents]):
            return str(path)
    return candidates[0]


def _write_id_maps(pid: int) -> None:
    """Map the launcher's user namespace: as root, root (the launcher) and nobody (the program); else oneself."""
    uid, gid = os.geteuid(), os.getegid()
    proc = Path(f"/proc/{pid}")
    if uid == 0:
        (proc / "uid_map").write_text(f"0 0 1\n{NOBODY} {NOBODY} 1\n")
        (proc / "gid_map").write_text(f"0 0 1\n{NOBODY} {NOBODY} 1\n")
    else:
        (proc / "setgroups").write_text("deny")
        (proc / "uid_map").write_text(f"{uid} {uid} 1\n")
        (proc / "gid_map").write_text(f"{gid} {gid} 1\n")


def _read_all(fd: int, limit: int = 1 << 16) -> bytes:
    out = b""
    while len(out) < limit:
        try:
            chunk = os.read(fd, limit - len(out))
        except BlockingIOError:
            break
        if not chunk:
            break
        out += chunk
    return out


def _read_head(path: Path, n: int) -> str:
    try:
        with open(path, "rb") as f:
            return f.read(n).decode("utf-8", errors="replace")
    except OSError:
        return ""


def _refusal(layer: str, why: str) -> SandboxUnavailable:
    return SandboxUnavailable(
        f"HumanEval's sandbox needs the kernel's {layer.replace('_', ' ')}, which this machine refuses ({why}); "
        "run where it is allowed (root, or unprivileged user namespaces) or pass --unsafe-local-exec to run "
        "model-written code without it")


_backend: str | None = None  # "bwrap" | "launcher", chosen once per process (see backend())


def use_backend(name: str | None) -> None:
    """Pin the backend ("bwrap" or "launcher"), or None to choose again (tests run the escapes on both)."""
    global _backend
    _backend = name


def backend() -> str:
    """bubblewrap where `bwrap` is installed and runs a check here; else the ctypes launcher."""
    global _backend
    if _backend is None:
        _backend = "launcher"
        if shutil.which("bwrap"):
            try:
                probe = _run("pass", SandboxLimits(timeout_s=10), None, "bwrap")
                if probe.passed and probe.layers.get("seccomp"):
                    _backend = "bwrap"
            except UserError:
                pass
    return _backend


def run_python(program: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run `program` (Python source) in the sandbox; passed when it ran to its end. Never raises for what the
    program does. Raises SandboxUnavailable when a layer is refused and unsafe local execution was not allowed.

    Not for scoring untrusted code against tests (the token sits in the runner's frame): that is `run_check`."""
    return _run(program, limits or SandboxLimits(), None, backend())


def run_check(code: str, check_source: str, entry_point: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """HumanEval's check: `code` (the completion) runs in the sandbox; `check_source` (the problem's trusted code,
    defining `check`) runs in a separate trusted checker process that calls `check(candidate)`, each call of
    `candidate` crossing to the sandbox and back as data. Passed only when `check` returned."""
    return _run(code, limits or SandboxLimits(), (check_source, entry_point), backend())


def _run(program: str, limits: SandboxLimits, serve: tuple[str, str] | None, how: str) -> SandboxResult:
    strict = not _unsafe
    python, prefix = _interpreter()
    token = secrets.token_hex(16).encode()
    _clean_stale()
    # the harness's pid in the names: what a harness killed with -9 left is removed by the next check
    workdir = Path(tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{os.getpid()}-"))
    cgroup = _new_cgroup(limits.memory_bytes)
    pipes: list[int] = []
    checker = None

    def pipe():
        r, w = os.pipe()
        pipes.extend((r, w))
        return r, w

    def close(*fds):
        for fd in fds:
            os.close(fd)
            pipes.remove(fd)

    try:
        box = workdir / "box"
        box.mkdir()
        (box / "program.py").write_text(program)
        os.chmod(workdir, 0o711)  # without a mount namespace (unsafe) the program reaches box/ by its host path
        os.chmod(box, 0o755)  # readable by the program's user, not writable
        os.chmod(box / "program.py", 0o644)
        (workdir / "root").mkdir()
        token_r, token_w = pipe()
        result_r, result_w = pipe()
        status_r, status_w = pipe()
        go_r, go_w = pipe()
        if serve is None:
            os.write(token_w, token)
            close(token_w)
        config = {
            "python": python, "prefix": prefix, "host_python": _host_interpreter(),
            "box": str(box), "root": str(workdir / "root"),
            "strict": strict, "status_fd": status_w, "result_fd": result_w, "go_fd": go_r, "harness_pid": os.getpid(),
            "uid": NOBODY if os.geteuid() == 0 else os.geteuid(), "gid": NOBODY if os.geteuid() == 0 else os.getegid(),
            "limits": limits.__dict__, "bpf": _filter_hex(strict),
        }
        if how == "bwrap":
            bwrap_python = _host_interpreter()  # bwrap runs as `nobody`: a python it can reach
            config.update(bwrap=shutil.which("bwrap"), bwrap_python=bwrap_python,
                          bwrap_prefix=str(Path(bwrap_python).parents[1]),
                          bwrap_bpf=seccomp_filter(allow=sandbox_launcher.BWRAP_ALLOWS).hex())
        launcher_fds = [result_w, status_w, go_r]
        if serve is not None:
            calls_r, calls_w = pipe()
            verdict_r, verdict_w = pipe()
            config.update(calls_fd=calls_r, serve=serve[1])
            launcher_fds.append(calls_r)
            source = workdir / "check.py"  # outside box/: the program never sees the tests
            source.write_text(serve[0])
            os.chmod(source, 0o600)
        start = time.monotonic()
        with open(workdir / "stdout", "wb") as out, open(workdir / "stderr", "wb") as err:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-B", sandbox_launcher.__file__, *(["--bwrap"] if how == "bwrap" else []),
                 json.dumps(config)],
                stdin=subprocess.DEVNULL if serve else token_r, stdout=out, stderr=err, pass_fds=launcher_fds,
                close_fds=True, start_new_session=True, cwd="/",
            )
        close(*launcher_fds)
        if serve is not None:
            with open(workdir / "check.out", "wb") as out:
                checker = subprocess.Popen(
                    [sys.executable, "-I", "-S", "-B", sandbox_launcher.__file__, "--check", str(calls_w),
                     str(result_r), str(verdict_w), str(source), serve[1]],
                    stdin=token_r, stdout=out, stderr=subprocess.STDOUT, pass_fds=(calls_w, result_r, verdict_w),
                    close_fds=True, start_new_session=True, cwd=str(workdir),
                )
            close(calls_w, result_r, verdict_w)  # the program sees EOF on its calls once the checker is done
            # the checker counts in the check's memory bound: in its cgroup, else with its own share of the bound;
            # it reads its limit and token (to EOF) before anything else, so it holds nothing before it counts
            joined = cgroup is not None and _join(cgroup, checker.pid)
            space = limits.memory_bytes if joined else sandbox_launcher.share_bytes(limits.__dict__, serve=True)
            os.write(token_w, f"{space}\n".encode() + token)
            close(token_w)
        close(token_r)
        try:
            messages, timed_out = _talk(proc, status_r, go_w, limits.timeout_s + 10.0, cgroup)
            if how == "bwrap" and not timed_out:  # the status pipe closed at exec: bwrap's exit is the program's
                try:
                    rc = proc.wait(max(0.0, start + limits.timeout_s - time.monotonic()))
                    messages.append({"status": "exited", "returncode": -(rc - 128) if rc > 128 else rc,
                                     "python": config["bwrap_python"]})
                except subprocess.TimeoutExpired:
                    timed_out = True
            if checker is not None:
                try:  # the program is gone, so every call the checker makes fails at once
                    checker.wait(max(0.5, start + limits.timeout_s - time.monotonic()))
                except subprocess.TimeoutExpired:
                    timed_out = True
        finally:
            for child in filter(None, (proc, checker)):
                try:
                    os.killpg(child.pid, signal.SIGKILL)  # the program dies with the launcher (parent-death signal)
                except (ProcessLookupError, PermissionError):
                    pass
                child.wait()
        wall = time.monotonic() - start
        replies = result_r if serve is None else verdict_r
        os.set_blocking(replies, False)
        results = _read_all(replies)
        final = messages[-1] if messages and "status" in messages[-1] else {}
        layers = dict(next((m["layers"] for m in reversed(messages) if "layers" in m), {}))
        layers["python"] = final.get("python")
        seccomp_line, _, emitted = results.partition(b"\n")
        layers["seccomp"] = seccomp_line == b"seccomp"
        layers["unsafe_local_exec"] = not strict
        layers["backend"] = how
        if how == "bwrap" and seccomp_line != b"seccomp" and _read_head(workdir / "stderr", 6) == "bwrap:":
            return _run(program, limits, serve, "launcher")  # bwrap could not set up here: the launcher names why
        refused = next((m for m in messages if "refused" in m), None)
        if refused is not None:
            raise _refusal(refused["refused"], refused["why"])
        if strict and seccomp_line.startswith(b"!seccomp"):
            raise _refusal("seccomp", seccomp_line.decode(errors="replace")[len("!seccomp "):])
        failed = next((m["error"] for m in messages if "error" in m), None)
        if failed is None and not final and not timed_out:
            failed = "the launcher stopped: " + (_read_head(workdir / "stderr", 4096).strip().splitlines() or ["?"])[-1]
        if failed is not None:  # no program ran: a fault of the sandbox, not of the program
            raise SandboxUnavailable(f"HumanEval's sandbox could not start a program: {failed}")
        rc = final.get("returncode")
        if serve is not None and emitted == token:  # check() returned in the trusted checker
            status = "passed"
        elif timed_out or final.get("status") == "timeout":
            status = "timeout"
        elif serve is None and emitted == token and rc == 0:
            status = "passed"
        elif rc is not None and rc < 0:
            status = "killed"
        else:
            status = "failed"
        return SandboxResult(
            passed=status == "passed", status=status, returncode=rc,
            stdout=_read_head(workdir / "stdout", limits.output_bytes),
            stderr=_read_head(workdir / "stderr", limits.output_bytes), wall_s=wall, layers=layers,
            check_output=_read_head(workdir / "check.out", limits.output_bytes) if serve else "",
        )
    finally:
        for fd in pipes:
            os.close(fd)
        shutil.rmtree(workdir, ignore_errors=True)
        if cgroup is not None:
            _remove_cgroup(cgroup)


TEMP_PREFIX = "melt-eval-sandbox-"
CGROUP_PREFIX = "melt-eval-check-"


def _dead(name: str, prefix: str) -> bool:
    """Whether the harness whose pid follows `prefix` in `name` is gone (its leftovers are ours to remove)."""
    pid = name[len(prefix):].split("-", 1)[0]
    if not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _clean_stale() -> None:
    """Remove the temp directories and cgroups of harnesses that died mid-check (kill -9 runs no `finally`)."""
    try:
        names = os.listdir(tempfile.gettempdir())
    except OSError:
        names = []
    for name in names:
        if name.startswith(TEMP_PREFIX) and _dead(name, TEMP_PREFIX):
            shutil.rmtree(Path(tempfile.gettempdir()) / name, ignore_errors=True)
    parent = _memory_cgroup_parent()
    if parent is not None:
        for child in parent.glob(CGROUP_PREFIX + "*"):
            if _dead(child.name, CGROUP_PREFIX):
                _remove_cgroup(child)


def _memory_cgroup_parent() -> Path | None:
    """This process's cgroup in a hierarchy with the memory controller (v1 `memory`, or v2 with memory enabled
    for children), where the harness may make a child; None where there is none or it is not writable."""
    try:
        mounts = Path("/proc/self/mountinfo").read_text().splitlines()
        groups = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in mounts:
        fields, _, rest = line.partition(" - ")
        parts, (fstype, _, options) = fields.split(), (rest.split() + ["", "", ""])[:3]
        root, mount = parts[3], parts[4]
        for group in groups:
            _, controllers, path = group.split(":", 2)
            v1 = fstype == "cgroup" and "memory" in options.split(",") and "memory" in controllers.split(",")
            v2 = fstype == "cgroup2" and controllers == ""
            if not (v1 or v2) or not (path + "/").startswith(root.rstrip("/") + "/"):
                continue
            where = Path(mount) / path[len(root.rstrip("/")):].lstrip("/")
            if v2:
                try:
                    if "memory" not in (where / "cgroup.subtree_control").read_text().split():
                        continue
                except OSError:
                    continue
            if os.access(where, os.W_OK):
                return where
    return None


def _new_cgroup(memory_bytes: int) -> Path | None:
    """A memory cgroup for one check, bounding all its processes together (page cache, tmpfs and pipes
    included); None where the harness cannot make one (then the budget is split by address space)."""
    parent = _memory_cgroup_parent()
    if parent is None:
        return None
    group = parent / f"{CGROUP_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
    try:
        group.mkdir()
    except OSError:
        return None
    try:
        if (group / "memory.limit_in_bytes").exists():  # v1
            (group / "memory.limit_in_bytes").write_text(str(memory_bytes))
            for swap in ("memory.memsw.limit_in_bytes",):  # no swapping around the bound, where swap accounting is on
                try:
                    (group / swap).write_text(str(memory_bytes))
                except OSError:
                    pass
        else:  # v2
            (group / "memory.max").write_text(str(memory_bytes))
            try:
                (group / "memory.swap.max").write_text("0")
            except OSError:
                pass
    except OSError:
        _remove_cgroup(group)
        return None
    return group


def _join(group: Path, pid: int) -> bool:
    try:
        (group / "cgroup.procs").write_text(str(pid))
        return True
    except OSError:
        return False


def _remove_cgroup(group: Path) -> None:
    """rmdir once its processes are gone (the kernel frees the last ones a moment after they are reaped)."""
    for _ in range(50):
        try:
            group.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.01)


def _filter_hex(strict: bool) -> str:
    try:
        return seccomp_filter().hex()
    except OSError:
        if strict:
            raise _refusal("seccomp", f"no filter for {os.uname().machine}") from None
        return ""


def _talk(proc: subprocess.Popen, status_r: int, go_w: int, timeout: float,
          cgroup: Path | None = None) -> tuple[list[dict], bool]:
    """Read the launcher's status lines until it exits; when it asks, map its user namespace and move it into
    the check's memory cgroup (before it forks: the init and the program inherit it)."""
    import select

    deadline = time.monotonic() + timeout
    messages, buf = [], b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return messages, True
        ready, _, _ = select.select([status_r], [], [], left)
        if not ready:
            continue
        chunk = os.read(status_r, 4096)
        if not chunk:  # the launcher and the program are gone
            return messages, False
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            msg = json.loads(line)
            messages.append(msg)
            if msg.get("stage") == "unshared":
                if msg["layers"].get("user_namespace") and not msg.get("mapped"):
                    try:
                        _write_id_maps(proc.pid)
                    except OSError as e:
                        raise _refusal("user_namespace", f"mapping its ids: {e}") from None
                os.write(go_w, b"g" if cgroup is not None and _join(cgroup, proc.pid) else b"b")


def describe() -> dict:
    """Which containment layers are active here (raises SandboxUnavailable if one is refused, unless unsafe)."""
    probe = run_python("pass", SandboxLimits(timeout_s=10))
    return {**probe.layers,
            # names results have carried since the first sandbox
            "drops_to_nobody": probe.layers.get("unprivileged", False) and os.geteuid() == 0,
            "private_tmp": probe.layers.get("mount_namespace", False)}


def require(unsafe_local_exec: bool = False) -> dict:
    """Before HumanEval: fail closed (SandboxUnavailable, one line) unless every layer works or unsafe is asked."""
    allow_unsafe_local_exec(unsafe_local_exec)
    return describe()

