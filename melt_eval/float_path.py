"""The float path: which kernels do the arithmetic, pinned so that a seed gives the same bits on any x86-64 CPU
with AVX2, whatever its vendor, vector width or core count (docs/reproducibility.md).

A CPU picks its own kernels: PyTorch's ATen dispatches to AVX-512 code where the CPU has it, MKL to the branch it
likes best, and every parallel reduction splits by the number of threads. Each choice rounds differently, the
floats part within ten training steps, and the demo's verdicts then follow the machine as much as the seed. What
was measured to move the bits of a 4-step `tiny-phase1` run, and is therefore pinned here:

- `ATEN_CPU_CAPABILITY=avx2`: ATen's AVX2 kernels (and Inductor's AVX2 code) even where AVX-512 exists;
- `MKL_CBWR=AVX2`: MKL's conditional numerical reproducibility on its AVX2 branch (fixed blocking, static
  scheduling, deterministic reductions);
- the intra-op thread count: `THREADS` for a command's own process (the demo's and ablate's side-by-side jobs
  take one each), however many cores the machine has.

oneDNN's instruction set (`ONEDNN_MAX_CPU_ISA`) moved nothing (the CPU path trains in fp32, which oneDNN does not
compute), so it is left alone. The pin is set in the environment before torch loads, so child processes (jobs,
torchrun ranks, vLLM's engine) inherit it. A user's own value of any of these variables wins, and
`MELT_EVAL_FLOAT_PATH=native` turns the pin off for a machine where speed matters more than published bits.
"""

from __future__ import annotations

import os
import platform
import sys
from importlib import metadata

SWITCH = "MELT_EVAL_FLOAT_PATH"  # "native": no pin
PINNED = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2"}
THREADS = 2  # a command's intra-op threads; more cores change nothing, fewer only run slower
THREADS_VARIABLE = "OMP_NUM_THREADS"  # read by torch (and MKL) when they load
# the variables pin() set (not the user), inherited with them: torchrun's thread rule for a launch's workers (1
# unless the user set OMP_NUM_THREADS) must tell the pin's value from a user's
SET_BY_PIN = "MELT_EVAL_FLOAT_PATH_SET"
PUBLISHED_TORCH = "2.13.0+cpu"  # the build (and its bundled MKL) the published numbers were computed with
# MKL's code branches (mkl_cbwr.h): what `mkl_serv_cbwr_get` reports; on a non-Intel CPU MKL takes AUTO for AVX2
MKL_BRANCHES = {1: "OFF", 2: "AUTO", 3: "COMPATIBLE", 4: "SSE2", 8: "SSE4_2", 9: "AVX", 10: "AVX2", 12: "AVX512",
                14: "AVX512_E1", 15: "AVX512_E2", 16: "AVX512_E3", 17: "AVX512_E4", 18: "AVX2_E1", 19: "AVX512_E5"}


def pinned() -> bool:
    return os.environ.get(SWITCH, "").strip().lower() != "native"


def switch_error() -> str | None:
    """What is wrong with the switch's value, if anything: a misspelt "native" would keep the pin unseen."""
    value = os.environ.get(SWITCH)
    if value is None or value.strip().lower() in ("", "native"):
        return None
    return f"{SWITCH}={value!r} is not a setting: set it to native to turn the pinned float path off, or unset it"


def pin() -> None:
    """Set the float path in the environment, before torch loads; a variable the user set keeps its value."""
    if not pinned():
        return
    ours = set(filter(None, os.environ.get(SET_BY_PIN, "").split(",")))
    for name, value in dict(PINNED, **{THREADS_VARIABLE: str(THREADS)}).items():
        if name not in os.environ:
            os.environ[name] = value
            ours.add(name)
    if ours:
        os.environ[SET_BY_PIN] = ",".join(sorted(ours))


def set_by_user(name: str) -> bool:
    """Whether the environment's value of `name` is the user's own (not one pin() set, here or in a parent)."""
    return name in os.environ and name not in os.environ.get(SET_BY_PIN, "").split(",")


def cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux reports them (empty where /proc/cpuinfo is not there)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_vendor() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _torch_version() -> str | None:
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


def why_not_published() -> str | None:
    """Why this process cannot give the published bits (None where it can): no pin, a variable set to another
    value, a CPU without AVX2/FMA, another architecture, another torch. Read without importing torch."""
    if not pinned():
        return f"the float path is not pinned ({SWITCH}=native)"
    wanted = dict(PINNED, **{THREADS_VARIABLE: str(THREADS)})
    other = [f"{k}={os.environ[k]}" for k in wanted if os.environ.get(k, wanted[k]) != wanted[k]]
    if other:
        return (f"{', '.join(other)} overrides the pinned float path "
                f"({', '.join(f'{k}={v}' for k, v in wanted.items())})")
    machine = platform.machine().lower()
    if machine not in ("x86_64", "amd64"):
        return f"this is a {platform.machine()} machine; they were computed on x86-64 with AVX2"
    missing = sorted({"avx2", "fma"} - cpu_flags()) if sys.platform == "linux" else []
    if missing:
        return f"this CPU lacks {' and '.join(m.upper() for m in missing)}; they were computed with AVX2 kernels"
    torch_version = _torch_version()
    if torch_version != PUBLISHED_TORCH:
        return f"this is torch {torch_version}; they were computed with torch {PUBLISHED_TORCH}"
    return None


def notice() -> str | None:
    """The one line a computing command prints first where its numbers will not be the published ones."""
    why = why_not_published()
    return None if why is None else f"note: {why}, so this run's numbers need not match the published ones bit for bit"


def _mkl_branch() -> str | None:
    """The MKL code branch in force (after MKL's own choice: AUTO on a CPU it does not take AVX2 on)."""
    import ctypes

    import torch

    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
        code = lib.mkl_serv_cbwr_get(1)  # MKL_CBWR_BRANCH
    except (OSError, AttributeError):  # another build (no bundled MKL, another platform)
        return None
    return MKL_BRANCHES.get(code, str(code))


def describe() -> dict:
    """The float path this process computes with, for results.json, melt_eval_training.json and demo.json.
    `key()` of it is what two runs must share to be comparable bit for bit; the CPU fields are information."""
    import torch

    mkl = _mkl_version_from_config() if torch.backends.mkl.is_available() else None
    flags = cpu_flags()
    return {
        "pinned": pinned(), "kernels": torch.backends.cpu.get_cpu_capability(), "mkl_cbwr": os.environ.get("MKL_CBWR"),
        "mkl_branch": _mkl_branch(), "threads": torch.get_num_threads(), "torch": torch.__version__, "mkl": mkl,
        "machine": platform.machine(), "cpu_vendor": cpu_vendor(),
        "cpu_vector": "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else None,
    }


def _mkl_version_from_config() -> str | None:
    import torch

    for line in torch.__config__.show().splitlines():
        if "Math Kernel Library Version" in line:
            return line.split("Version", 1)[1].strip().split("-")[0]
    return None


KEY_FIELDS = ("pinned", "kernels", "mkl_cbwr", "threads", "torch", "mkl")


def key(path: dict | None) -> tuple | None:
    """What decides the bits: the fields two float paths must share (None: a file from before the record)."""
    if not isinstance(path, dict):
        return None
    return tuple(path.get(k) for k in KEY_FIELDS)


def label(path: dict | None) -> str:
    if not isinstance(path, dict):
        return "not recorded"
    return (f"{path.get('kernels')} kernels, MKL_CBWR={path.get('mkl_cbwr')}, {path.get('threads')} thread(s), "
            f"torch {path.get('torch')}" + ("" if path.get("pinned", True) else ", not pinned"))
