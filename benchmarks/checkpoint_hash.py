"""What checking checkpoints by content costs (issue 41, item 6): SHA-256 throughput measured here, and
in the same run the throughput of writing the same bytes with safetensors (what a save already costs),
then the hashing time of the 1.4B shape computed from the measured rate.

A training checkpoint of the 1.4B shape holds fp32 weights and AdamW's two fp32 moments (12 bytes per
parameter, Accelerate's state/), hashed once at each save and once at --resume; the exported model holds
bf16 weights (2 bytes per parameter), hashed once at the export and at each `run` (unless --no-verify).

    python benchmarks/checkpoint_hash.py [--mib 512] [--repeats 3]
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _args import Parser, whole  # noqa: E402

from melt_eval.files import sha256_file  # noqa: E402
from melt_eval.registry import get_spec  # noqa: E402


def best_of(repeats: int, fn) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=whole(1, 1 << 20), default=512, help="size of the measured file (MiB)")
    parser.add_argument("--repeats", type=whole(1), default=3)
    args = parser.parse_args()
    nbytes = args.mib << 20
    tensor = torch.randn(nbytes // 4)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "t.safetensors"
        def write() -> None:  # what a save does with these bytes: write them, then fsync them
            save_file({"w": tensor}, str(path))
            fd = os.open(path, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)

        write_s = best_of(args.repeats, write)
        sha256_file(path)  # warm the page cache: a save has just written these bytes, so they are cached
        hash_s = best_of(args.repeats, lambda: sha256_file(path))
    mib_s = args.mib / hash_s
    print(f"sha256: {mib_s:,.0f} MiB/s; safetensors write + sync: {args.mib / write_s:,.0f} MiB/s; "
          f"hash / write time: {hash_s / write_s:.2f}")
    params = get_spec("ouro-1.4b-thinking").params
    for what, per_param in (("training checkpoint (fp32 weights + AdamW moments)", 12), ("exported model (bf16)", 2)):
        size = params * per_param
        print(f"1.4B shape, {what}: {size / 2**30:,.1f} GiB -> {size / 2**20 / mib_s:,.1f} s to hash")


if __name__ == "__main__":
    main()
