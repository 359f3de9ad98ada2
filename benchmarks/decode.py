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

import torch

from melt_eval.generation import generate
from melt_eval.generation.options import InferenceOptions
from melt_eval.modeling import LoopLMConfig, LoopLMForCausalLM, MeltForCausalLM


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
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small contexts, for a smoke run")
    parser.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--contexts", default=None, help="comma-separated context lengths")
    parser.add_argument("--new", type=int, default=None, help="tokens decoded per sequence")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--loops", type=int, default=4)
    args = parser.parse_args()

    contexts = [int(c) for c in (args.contexts or ("64,256" if args.quick else "256,1024,4096")).split(",")]
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
