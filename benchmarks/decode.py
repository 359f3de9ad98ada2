"""Decode speed and KV-cache size of LoopLM vs MELT, same weights, same prompts, one run.

    python benchmarks/decode.py [--quick] [--json] [--device cpu|cuda] [--dtype float32|bfloat16]

For each context length the prompt is prefilled (one chunk, so prefill cost is the same for
both) and `--new` tokens are decoded greedily for `--batch` sequences. tokens_per_s counts
decode steps only (from the first sampled token to the last); cache_bytes is what the native
engine allocated. Report ratios from one run: absolute speed depends on the machine.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _args import Parser, device, whole, wholes  # noqa: E402

from melt_eval.generation import generate  # noqa: E402
from melt_eval.generation.options import InferenceOptions  # noqa: E402
from melt_eval.modeling import LoopLMConfig, LoopLMForCausalLM, MeltForCausalLM  # noqa: E402


def build_models(dtype, device, hidden: int, layers: int, loops: int):
    torch.manual_seed(0)
    config = LoopLMConfig(
        vocab_size=4096, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
        num_attention_heads=hidden // 64, head_dim=64, total_ut_steps=loops, max_position_embeddings=65536,
    )
    looplm = LoopLMForCausalLM(config).eval()
    melt = MeltForCausalLM.from_looplm(looplm, gate="elementwise").eval()
    return {"looplm": looplm.to(device, dtype), "melt": melt.to(device, dtype)}


def measure(model, context: int, new: int, batch: int, device) -> dict:
    g = torch.Generator().manual_seed(context)
    prompt = torch.randint(0, model.config.vocab_size, (context,), generator=g).tolist()
    stamps = []

    def tick(_):
        if device == "cuda":
            torch.cuda.synchronize()
        stamps.append(time.perf_counter())

    result = generate(model, [prompt], InferenceOptions(prefill_chunk=context), n=batch, temperature=0, max_new_tokens=new,
                      callback=tick)
    decode_steps = len(stamps) - 1
    elapsed = stamps[-1] - stamps[0]
    return {"tokens_per_s": decode_steps * batch / elapsed, "cache_bytes": result.peak_cache_bytes}


def main() -> None:
    parser = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small contexts, for a smoke run")
    parser.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    parser.add_argument("--device", type=device, default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    # up to the models' max_position_embeddings, with room for the decoded tokens
    parser.add_argument("--contexts", type=wholes(1), default=None, help="comma-separated context lengths")
    parser.add_argument("--new", type=whole(1, 4096), default=None, help="tokens decoded per sequence")
    parser.add_argument("--batch", type=whole(1), default=4)
    parser.add_argument("--hidden", type=whole(64), default=256, help="a multiple of 64 (heads of 64)")
    parser.add_argument("--layers", type=whole(1), default=4)
    parser.add_argument("--loops", type=whole(1), default=4)
    args = parser.parse_args()
    if args.hidden % 64:
        parser.error(f"--hidden must be a multiple of 64 (heads of 64), got {args.hidden}")
    if args.contexts and max(args.contexts) + (args.new or 32) > 65536:
        parser.error("--contexts plus --new must fit the models' 65,536 positions")

    contexts = list(args.contexts or ((64, 256) if args.quick else (256, 1024, 4096)))
    new = args.new or (8 if args.quick else 32)
    dtype = getattr(torch, args.dtype)
    models = build_models(dtype, args.device, args.hidden, args.layers, args.loops)
    rows = []
    for context in contexts:
        for name, model in models.items():
            measure(model, context, 4, args.batch, args.device)  # warm-up: same shapes, clocks up
            rows.append({"model": name, "context": context, **measure(model, context, new, args.batch, args.device)})
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    machine = f"{platform.machine()} {torch.get_num_threads()} threads" if args.device == "cpu" else torch.cuda.get_device_name()
    print(f"decode benchmark: d={args.hidden}, N={args.layers}, T={args.loops}, batch={args.batch}, {new} new tokens, "
          f"{args.dtype}, {args.device} ({machine})")
    print(f"{'context':>8} {'model':>7} {'tokens/s':>10} {'cache MB':>10} {'speed vs looplm':>16} {'cache vs looplm':>16}")
    for row in rows:
        ref = next(r for r in rows if r["context"] == row["context"] and r["model"] == "looplm")
        print(f"{row['context']:>8} {row['model']:>7} {row['tokens_per_s']:>10.1f} {row['cache_bytes'] / 1e6:>10.2f} "
              f"{row['tokens_per_s'] / ref['tokens_per_s']:>15.2f}x {row['cache_bytes'] / ref['cache_bytes']:>15.3f}x")


if __name__ == "__main__":
    main()
