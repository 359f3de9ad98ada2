"""Files the harness writes: atomic replacement, and one writer per directory.

Atomic writes follow the usual recipe (HF Trainer and torchtune do the same for checkpoints): write a
temporary file beside the target, fsync it, `os.replace` it over the target, fsync the directory. A
reader, or a run resumed after `kill -9`, a full disk or a power cut, sees the old file or the new
one, never a cut one.

`DirLock(dir)` makes one process the only writer of a directory (a results task directory, a
training output). It holds `fcntl.flock` on `dir/.melt-eval.lock`, a file that also records the
holder's PID, host and command, as pip's and git's lock files do, so a refused writer can be told
who holds it. The kernel drops a flock when its holder dies, however it dies, so a lock left by a
killed process (its PID dead) is simply taken over; there is no stale lock to delete by hand.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import socket
import stat
import sys
import tempfile
import time
from contextlib import suppress
from pathlib import Path

from melt_eval.errors import UserError

LOCK_NAME = ".melt-eval.lock"
# A training run's record (recipe, code, status) in its output directory, beside the exported model:
# training/run_files.py writes it; `run` and `serve` read its recipe (generation/options.py).
TRAINING_META = "melt_eval_training.json"

# The most a file the harness reads whole may hold: JSON(-lines) data, completions and results files are
# read into memory and parsed (a few times their size), so a bigger one, or /dev/zero, is refused up front.
# The paper's largest benchmark file (HLE's subset with its images) is far below this.
MAX_READ_BYTES = 1 << 30


def _describe_kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def check_regular_file(path: str | Path, what: str = "a file", max_bytes: int | None = MAX_READ_BYTES) -> int:
    """Before any file the harness reads is opened: it exists and is a regular file (a FIFO would block the
    open forever, a device like /dev/zero never ends), no bigger than `max_bytes` (None: any size, for
    files read in pieces, like weights). Returns its size; anything else is a one-line UserError."""
    path = Path(path)
    try:
        st = os.stat(path)  # follows symlinks: what would be opened
    except FileNotFoundError:
        raise UserError(f"{path} does not exist; pass {what}") from None
    except OSError as exc:  # ELOOP (a symlink loop), ENOTDIR, EACCES, ENAMETOOLONG
        raise UserError(f"cannot read {path} ({exc.strerror or type(exc).__name__}); pass {what}") from None
    if not stat.S_ISREG(st.st_mode):
        raise UserError(f"{path} is {_describe_kind(st.st_mode)}; pass {what} (a regular file)")
    if max_bytes is not None and st.st_size > max_bytes:
        raise UserError(f"{path} holds {st.st_size} bytes, more than the {max_bytes >> 20} MiB limit for {what}; "
                        "split it or pass a smaller file")
    return st.st_size


def check_output_path(path: str | Path, flag: str, *, directory: bool) -> None:
    """Before anything is written to `path` (a directory when `directory`, else a file): no existing part of
    it is of the wrong kind (`--output afile.txt/sub`, `--details /dev/full`), so no write fails half-way."""
    path = Path(path)
    for parent in path.parents:
        try:
            st = os.stat(parent)
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise UserError(f"{flag} {path}: cannot use {parent} ({exc.strerror}); pass another path") from None
        if not stat.S_ISDIR(st.st_mode):
            raise UserError(f"{flag} {path}: {parent} is a file, not a directory; pass another path")
        break
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise UserError(f"{flag} {path}: cannot use it ({exc.strerror}); pass another path") from None
    if directory and not stat.S_ISDIR(st.st_mode):
        raise UserError(f"{flag} {path} is {'a file' if stat.S_ISREG(st.st_mode) else _describe_kind(st.st_mode)}; "
                        "pass a directory")
    if not directory and not stat.S_ISREG(st.st_mode):
        raise UserError(f"{flag} {path} is {_describe_kind(st.st_mode)}; pass a regular file's path")


def write_failed(exc: OSError, path: str | Path, kept: str = "") -> UserError:
    """The one line for a write the disk refused (full, read-only, quota): what failed and what was kept."""
    full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
    why = "the disk is full" if full else (exc.strerror or type(exc).__name__)
    fix = "free space and re-run" if full else "pass a path you can write and re-run"  # read-only, no such folder, ...
    return UserError(f"cannot write {path}: {why}" + (f"; {kept}" if kept else "") + f"; {fix}")


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (a rename, a new file) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under `root` (a checkpoint before it is renamed into place)."""
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


def write_bytes_atomic(path: Path, data: bytes) -> None:
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def write_text_atomic(path: Path, text: str) -> None:
    write_bytes_atomic(path, text.encode("utf-8"))


def write_json_atomic(path: Path, obj) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, default=str) + "\n")


def remove_tree(path: Path) -> None:
    """Delete a directory so that an interruption never leaves a part of it under its own name:
    rename it to a hidden `.trash-` sibling first, then delete that."""
    trash = path.with_name(f".trash-{path.name}-{os.getpid()}")
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


# ------------------------------------------------------------------------------- locks


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _exited(holder: dict) -> bool:
    """The record names a process on this host (or no host) that no longer runs."""
    return holder.get("host") in (None, socket.gethostname()) and not _alive(holder["pid"])


def _describe(holder: dict, lock_file: Path) -> str:
    pid, host = holder.get("pid"), holder.get("host")
    if not isinstance(pid, int):
        return "a process that is just starting"
    where = f"PID {pid}" + (f" on {host}" if host and host != socket.gethostname() else "")
    if _exited(holder):
        return f"a process started by {where}, which has exited (find it with `fuser {lock_file}`)"
    since = holder.get("since")
    command = str(holder.get("command") or "")[:120]
    return where + (f", since {since}" if since else "") + (f": {command}" if command else "")


class DirLock:
    """The exclusive writer's lock on `directory` (created if missing). Use as a context manager;
    a second writer gets a UserError naming the holder's PID. Nothing waits: a refused writer exits.

    `what` names the writer in the message ("evaluation", "training run"). `previous` is the record of
    a holder that died holding it (its lock was taken over), else None.
    """

    def __init__(self, directory: Path, what: str) -> None:
        self.directory = Path(directory)
        self.path = self.directory / LOCK_NAME
        self.what = what
        self.fd: int | None = None
        self.created: list[Path] = []  # directories this lock made, removed again if left empty
        self.previous: dict | None = None

    def __enter__(self) -> "DirLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def acquire(self) -> None:
        try:
            self._acquire()
        except BaseException:
            self._remove_created()
            raise

    def _acquire(self) -> None:
        if self.directory.exists() and not self.directory.is_dir():
            raise UserError(f"{self.directory} is a file; the {self.what} needs a directory there: choose another path")
        for _ in range(50):
            self._make_directory()
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except FileNotFoundError:  # a releasing holder removed the (empty) directory in between
                continue
            except OSError as exc:
                raise UserError(f"cannot write to {self.directory} ({exc.strerror}); choose another path") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder_record(fd)
                os.close(fd)
                raise UserError(
                    f"{self.directory} is being written by another {self.what} ({_describe(holder, self.path)}); "
                    "wait for it to finish or stop it: two writers would mix their files"
                ) from None
            except OSError as exc:  # e.g. ENOLCK on a network filesystem without locks
                os.close(fd)
                raise UserError(f"cannot lock {self.path} ({exc.strerror}); write to a local directory") from None
            # the previous holder unlinks the file before unlocking it: what we locked must still be the file
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                continue
            self.previous = _read_record(fd) or None
            command = " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])[:300]
            record = {"pid": os.getpid(), "host": socket.gethostname(),
                      "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "command": command}
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
            self.fd = fd
            return
        raise UserError(f"could not lock {self.directory}: it kept changing under us; try again")

    def release(self) -> None:
        if self.fd is None:
            return
        with suppress(OSError):  # unlink while still holding it, so nobody locks a file about to vanish
            os.unlink(self.path)
        os.close(self.fd)
        self.fd = None
        self._remove_created()

    def _remove_created(self) -> None:
        for made in reversed(self.created):  # a refused or failed writer leaves no empty directories
            try:
                made.rmdir()
            except OSError:
                break
        self.created = []

    def _make_directory(self) -> None:
        missing = []
        d = self.directory
        while not d.exists() and d != d.parent:
            missing.append(d)
            d = d.parent
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            raise UserError(f"cannot create {self.directory}: a part of that path is a file; choose another path") from None
        except OSError as exc:
            raise UserError(f"cannot create {self.directory} ({exc.strerror}); choose another path") from None
        for made in reversed(missing):
            if made not in self.created:
                self.created.append(made)


def _holder_record(fd: int, wait: float = 2.0) -> dict:
    """The lock holder's record, as a refused writer sees it. A holder writes its record just after it
    takes the flock; one refused inside that window would read an empty record, or the record of the
    dead holder it took over, so wait (briefly) for a live PID to appear."""
    deadline = time.monotonic() + wait
    while True:
        record = _read_record(fd)
        settled = isinstance(record.get("pid"), int) and not _exited(record)
        if settled or time.monotonic() >= deadline:
            return record
        time.sleep(0.02)


def _read_record(fd: int) -> dict:
    try:
        record = json.loads(os.pread(fd, 4096, 0).decode("utf-8", "replace") or "{}")
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


def clear_directory(directory: Path) -> None:
    """Delete everything in `directory` except its lock file (`--force` while holding the lock)."""
    for child in Path(directory).iterdir():
        if child.name == LOCK_NAME:
            continue
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()


# --- content hashes: a checkpoint checked by what it holds, not only by its sizes ---------------------------

SUMS_FILE = "SHA256SUMS"  # `sha256sum -c SHA256SUMS` checks it too (the coreutils format)
_verified: dict[tuple, None] = {}  # directories (their files' mtimes and sizes) already checked in this process
verified_dirs: set[str] = set()  # resolved paths of the directories whose sums this process checked (results.json)


def sha256_file(path: Path) -> str:
    """The file's SHA-256 as hex, read in blocks (a weights file may be larger than memory)."""
    import hashlib

    with Path(path).open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def hash_mismatches(root: Path, hashes: dict[str, str]) -> list[str]:
    """The files under `root` (relative names) that are missing or whose SHA-256 differs from `hashes`."""
    bad = []
    for rel, digest in hashes.items():
        path = root / rel
        if not path.is_file():
            bad.append(f"{rel} is missing")
        elif sha256_file(path) != digest:
            bad.append(f"{rel} does not match its SHA-256")
    return bad


def write_sums(directory: Path, names: list[str]) -> None:
    """DIR/SHA256SUMS for these files of DIR (atomically)."""
    lines = [f"{sha256_file(directory / name)}  {name}\n" for name in sorted(names)]
    write_text_atomic(directory / SUMS_FILE, "".join(lines))


def verify_sums(directory: Path) -> bool:
    """Check DIR's files against DIR/SHA256SUMS where it exists; a UserError naming the first damaged file.
    Returns whether sums were checked: False for a directory without them that this harness did not write (a
    Hub snapshot, another tool's). One it wrote (it holds TRAINING_META) always had them, so without them it
    is refused, as is a SHA256SUMS that is not a regular file (a FIFO, a device, a directory): a check that
    cannot run is never skipped silently. Checked once per process while unchanged (load_model and the
    backends both resolve the same directory)."""
    sums = Path(directory) / SUMS_FILE
    unchecked = "or pass --no-verify to load it unchecked"
    if not (sums.exists() or sums.is_symlink()):
        if (Path(directory) / TRAINING_META).exists():
            raise UserError(f"{directory} was written by melt-eval (it holds {TRAINING_META}) but has no {SUMS_FILE}, "
                            f"so its files cannot be checked; restore {SUMS_FILE} (copy the directory again), {unchecked}")
        return False
    try:
        check_regular_file(sums, f"the checkpoint's {SUMS_FILE}")
    except UserError as exc:
        raise UserError(f"{exc}; the checkpoint's files cannot be checked: restore it, {unchecked}") from None
    hashes = {}
    for line in sums.read_bytes().decode("utf-8", "replace").splitlines():
        digest, _, name = line.partition("  ")
        rel = Path(name)
        if len(digest) != 64 or not name or rel.is_absolute() or ".." in rel.parts:
            raise UserError(f"{sums} has a malformed line ({line[:80]!r}); restore it, or pass --no-verify to skip the check")
        hashes[name] = digest.lower()
    # unchanged since checked (same files, same mtimes and sizes): not read again
    stats = [(p, p.stat()) for p in [sums, *(Path(directory) / n for n in hashes)] if p.is_file()]
    key = (str(Path(directory).resolve()), *((str(p), st.st_mtime_ns, st.st_size) for p, st in stats))
    if key in _verified:
        verified_dirs.add(key[0])
        return True
    bad = hash_mismatches(Path(directory), hashes)
    if bad:
        raise UserError(f"{directory}: {bad[0]} recorded in {SUMS_FILE}: the checkpoint is damaged; "
                        "copy it again, or pass --no-verify to load it anyway")
    _verified[key] = None
    verified_dirs.add(key[0])
    return True
