"""Run untrusted Python (HumanEval completions) in a contained child process.

Layers, each one cheap and each one enough for a different failure:

* a separate process in its own session, killed as a whole process group at the end
  or when the wall-clock timeout passes (infinite loops, stray children);
* rlimits: CPU seconds, address space, number of processes, size of written files
  (so printing gigabytes stops at the cap), no core files;
* no network: a fresh network namespace (unshare(CLONE_NEWNET), with a user namespace
  when not root) where the kernel allows it, and always a Python-level guard that makes
  socket creation raise;
* as root, also a private mount namespace where /tmp, /var/tmp, /dev/shm and /run/lock are
  fresh 16 MiB tmpfs: the only places `nobody` could write, so a program cannot fill the
  disk with many capped files, and what it writes vanishes with it;
* when the harness runs as root and a world-executable interpreter exists, the child
  drops to `nobody`, so deleting or overwriting files outside its scratch dir fails in
  the kernel, and RLIMIT_NPROC (not enforced for root) stops fork bombs;
* a "reliability guard" prelude, like OpenAI's human-eval harness, that disables
  fork/exec/kill and file-destroying functions before the program runs;
* a throw-away working directory (also HOME and TMPDIR), removed afterwards, read-only to a
  program running as `nobody`; stdout and stderr go to files there (opened by the harness,
  capped by the file-size limit) and only their first bytes are read back.
"""

from __future__ import annotations

import ctypes
import os
import resource
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
MS_NOSUID, MS_NODEV, MS_REC, MS_PRIVATE = 2, 4, 1 << 14, 1 << 18
PRIVATE_TMP = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")
NOBODY_UID = NOBODY_GID = 65534

# Runs inside the child before the program: block sockets, then disable everything
# that can escape the scratch dir or spawn processes. Kept stdlib-only (python -I -S).
_PRELUDE = r'''
import builtins, os, shutil, socket, subprocess, sys
try:
    import _socket
except ImportError:
    _socket = None

def _blocked(*args, **kwargs):
    raise OSError("blocked by the melt-eval sandbox")

class _NoSocket:
    def __init__(self, *args, **kwargs):
        _blocked()

socket.socket = _NoSocket
for _name in ("create_connection", "create_server", "socketpair", "fromfd", "getaddrinfo", "gethostbyname"):
    setattr(socket, _name, _blocked)
if _socket is not None:
    _socket.socket = _NoSocket
    _socket.socketpair = _blocked

for _name in ("fork", "forkpty", "system", "popen", "kill", "killpg", "putenv", "remove", "removedirs",
              "rmdir", "unlink", "rename", "renames", "replace", "truncate", "ftruncate", "chmod", "fchmod",
              "chown", "fchown", "lchown", "chroot", "link", "symlink", "setuid", "setgid", "execv", "execve",
              "execvp", "execvpe", "execl", "execle", "execlp", "execlpe", "spawnv", "spawnve", "spawnvp",
              "spawnl", "posix_spawn", "posix_spawnp", "chdir", "fchdir"):
    for _module in (os, sys.modules.get("posix")):  # posix.* is what os.* wraps
        if _module is not None and hasattr(_module, _name):
            setattr(_module, _name, _blocked)
shutil.rmtree = shutil.move = shutil.chown = _blocked
subprocess.Popen = _NoSocket
builtins.help = None
sys.modules["ctypes"] = None
sys.modules["resource"] = None
sys.modules["psutil"] = None
sys.modules["_posixsubprocess"] = None

_path = sys.argv[1]
with open(_path) as _f:
    _code = compile(_f.read(), _path, "exec")
del _f
exec(_code, {"__name__": "__main__", "__file__": _path})
'''


@dataclass
class SandboxLimits:
    timeout_s: float = 10.0  # wall clock
    cpu_s: int = 10
    memory_bytes: int = 1 << 30  # address space
    max_processes: int = 16  # only enforced when the child is not root
    max_file_bytes: int = 1 << 20  # largest file the program may write (stdout included)
    output_bytes: int = 4096  # how much of stdout/stderr is read back


@dataclass
class SandboxResult:
    passed: bool  # exited 0 within the limits
    status: str  # "passed" | "failed" | "timeout" | "killed"
    returncode: int | None
    stdout: str
    stderr: str
    wall_s: float


def _world_executable(path: Path) -> bool:
    """Whether any user can execute `path` (every parent directory searchable)."""
    try:
        path = path.resolve()
        if not path.stat().st_mode & stat.S_IXOTH:
            return False
        return all(p.stat().st_mode & stat.S_IXOTH for p in path.parents)
    except OSError:
        return False


@lru_cache(maxsize=1)
def _interpreter() -> tuple[str, bool]:
    """(python to run, whether to drop to nobody). Prefer an interpreter nobody can run."""
    if os.geteuid() == 0:
        for cand in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
            if cand and Path(cand).exists() and _world_executable(Path(cand)):
                return str(Path(cand).resolve()), True
    return sys.executable, False


def _unshare(as_root: bool) -> None:
    """New network namespace; as root also a mount namespace with private, small temp dirs.
    Best effort: where the kernel refuses, the other layers still hold."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if not as_root:
            libc.unshare(CLONE_NEWUSER | CLONE_NEWNET)
            return
        if libc.unshare(CLONE_NEWNET | CLONE_NEWNS) != 0:
            libc.unshare(CLONE_NEWNET)
            return
        if libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) != 0:
            return  # mounts would propagate to the host: leave them alone
        for path in PRIVATE_TMP:
            if os.path.isdir(path):
                libc.mount(b"tmpfs", path.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, b"size=16m,mode=1777")
    except Exception:
        pass


def _child_setup(limits: SandboxLimits, drop: bool, workdir: str):
    def setup():  # runs in the child between fork and exec
        os.setsid()
        os.chdir(workdir)  # first: the private /tmp mounted next hides the path, not the open directory
        _unshare(os.geteuid() == 0)
        cpu = max(1, int(limits.cpu_s))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        resource.setrlimit(resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits.max_file_bytes, limits.max_file_bytes))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_NPROC, (limits.max_processes, limits.max_processes))
        if drop:
            os.setgroups([])
            os.setgid(NOBODY_GID)
            os.setuid(NOBODY_UID)

    return setup


def _read_head(path: Path, n: int) -> str:
    try:
        with open(path, "rb") as f:
            return f.read(n).decode("utf-8", errors="replace")
    except OSError:
        return ""


def run_python(program: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run `program` (Python source) in the sandbox; never raises for what the program does."""
    limits = limits or SandboxLimits()
    python, drop = _interpreter()
    workdir = Path(tempfile.mkdtemp(prefix="melt-eval-sandbox-"))
    try:
        (workdir / "program.py").write_text(program)
        os.chmod(workdir, 0o755)  # readable by `nobody`, not writable
        env = {"PATH": "/usr/bin:/bin", "HOME": str(workdir), "TMPDIR": str(workdir), "LANG": "C.UTF-8",
               "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1"}
        start = time.monotonic()
        with open(workdir / "stdout", "wb") as out, open(workdir / "stderr", "wb") as err:
            proc = subprocess.Popen(
                [python, "-I", "-S", "-B", "-c", _PRELUDE, "program.py"],  # relative: see _child_setup
                stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env, cwd=workdir,
                preexec_fn=_child_setup(limits, drop, str(workdir)), close_fds=True,
            )
            status = None
            try:
                proc.wait(timeout=limits.timeout_s)
            except subprocess.TimeoutExpired:
                status = "timeout"
            finally:
                # the whole group: children the program may have started die with it
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                proc.wait()
        wall = time.monotonic() - start
        rc = proc.returncode
        if status is None:
            status = "passed" if rc == 0 else ("killed" if rc < 0 else "failed")
        return SandboxResult(
            passed=status == "passed", status=status, returncode=rc,
            stdout=_read_head(workdir / "stdout", limits.output_bytes),
            stderr=_read_head(workdir / "stderr", limits.output_bytes), wall_s=wall,
        )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def describe() -> dict:
    """Which containment layers are active here."""
    python, drop = _interpreter()
    # in a fresh network namespace the only interface is the loopback one; a private /tmp is a small tmpfs
    probe = run_python("import os\nprint(sum(1 for l in open('/proc/self/net/dev') if ':' in l))\n"
                       "st = os.statvfs('/tmp')\nprint(st.f_blocks * st.f_frsize <= 16 << 20)", SandboxLimits(timeout_s=10))
    lines = probe.stdout.split()
    return {"python": python, "drops_to_nobody": drop,
            "network_namespace": probe.passed and lines[:1] == ["1"],
            "private_tmp": probe.passed and lines[1:2] == ["True"]}
