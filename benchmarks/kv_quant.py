"""Native-engine decode speed and cache bytes with quantized KV caches, against the model's own dtype, one run.

    python benchmarks/kv_quant.py [--contexts 256,1024] [--new 64] [--batch 4] [--repeats 3] [--threads 1] [--json]

The tiny preset (tiny-random-ouro's dimensions: 2 layers, hidden 128, 2 heads of 64, T = 4) in float32 on
the CPU (bfloat16 with --dtype). For Ouro and MELT and each context, every cache format (auto, fp8, int8,
int4, and Ouro's cross-loop deltas) prefills the same random prompt in one chunk and decodes `--new`
tokens greedily for `--batch` rows; the formats run interleaved, `--repeats` times, and each keeps its
best decode rate (a shared machine's noise only slows a run down). tokens_per_s counts decode steps only;
cache_bytes is what the engine allocated (Tensor.nbytes), analytic_bytes cache_layout's formula for it.
Report the ratios: absolute speed depends on the machine. `--threads` is torch's thread count (default 1: on a
shared machine a second OpenMP thread that loses its core stalls every operation, and the ratios with it).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _args import Parser, whole, wholes  # noqa: E402

from melt_eval.generation import generate  # noqa: E402
from melt_eval.generation.options import InferenceOptions  # noqa: E402
from melt_eval.modeling.melt import MeltForCausalLM  # noqa: E402
from melt_eval.modeling.tiny import build_tokenizer, make_tiny_looplm  # noqa: E402

FORMATS = {"auto": {}, "fp8": {"kv_cache_dtype": "fp8"}, "int8": {"kv_cache_dtype": "int8"},
           "int4": {"kv_cache_dtype": "int4"}, "cross-loop": {"cross_loop_kv": True}}


def run(model, prompt, options: dict, new: int, batch: int) -> dict:
    stamps = []
    result = generate(model, [prompt], InferenceOptions(prefill_chunk=len(prompt), **options), n=batch, temperature=0,
                      max_new_tokens=new, callback=lambda _: stamps.append(time.perf_counter()))
    steps = len(stamps) - 1
    return {"tokens_per_s": steps * batch / (stamps[-1] - stamps[0]), "cache_bytes": result.peak_cache_bytes,
            "analytic_bytes": result.analytic_cache_bytes}


def main() -> None:
    parser = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=wholes(1), default=(256, 1024))
    parser.add_argument("--new", type=whole(2), default=64)
    parser.add_argument("--batch", type=whole(1), default=4)
    parser.add_argument("--repeats", type=whole(1), default=3)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=whole(0), default=1, help="torch threads (0: torch's default)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if max(args.contexts) + args.new > 4096:
        parser.error("--contexts plus --new must fit the tiny model's 4,096 positions")
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    ouro = make_tiny_looplm(build_tokenizer()).eval()
    models = {"ouro": ouro.to(dtype), "melt": MeltForCausalLM.from_looplm(ouro, gate="elementwise", seed=0).eval().to(dtype)}
    rows = []
    for name, model in models.items():
        for context in args.contexts:
            prompt = torch.randint(5, model.config.vocab_size, (context,), generator=torch.Generator().manual_seed(context)).tolist()
            formats = {k: v for k, v in FORMATS.items() if name == "ouro" or k != "cross-loop"}
            best: dict = {}
            for _ in range(args.repeats):
                for fmt, options in formats.items():
                    r = run(model, prompt, options, args.new, args.batch)
                    if fmt not in best or r["tokens_per_s"] > best[fmt]["tokens_per_s"]:
                        best[fmt] = r
            for fmt, r in best.items():
                rows.append({"model": name, "context": context, "format": fmt, **r,
                             "speed_vs_auto": r["tokens_per_s"] / best["auto"]["tokens_per_s"],
                             "bytes_vs_auto": r["cache_bytes"] / best["auto"]["cache_bytes"]})
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"{'model':6} {'ctx':>5} {'format':10} {'tok/s':>8} {'x auto':>7} {'cache bytes':>12} {'analytic':>12} {'x auto':>7}")
    for r in rows:
        print(f"{r['model']:6} {r['context']:5d} {r['format']:10} {r['tokens_per_s']:8.1f} {r['speed_vs_auto']:7.2f} "
              f"{r['cache_bytes']:12,d} {r['analytic_bytes']:12,d} {r['bytes_vs_auto']:7.3f}")


if __name__ == "__main__":
    main()
