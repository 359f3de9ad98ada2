"""Training throughput of chunk-wise MELT against fully parallel training (C = L).

MELT's keys/values depend on each token's final loop, so a sequence is trained in chunks
of C tokens, one after the other (docs/method.md#chunks): smaller C is closer to inference
and slower. This measures optimiser steps of the real training path
(`melt_eval.training.runner.forward_objective`, SFT objective at alpha = 1, AdamW with the
two parameter groups) for several C in one run, next to C = L and to the LoopLM itself.

    python benchmarks/train_throughput.py [--quick] [--json] [--preset tiny|small|ouro-1.4b]
        [--seq-len L] [--batch B] [--chunks 16,64,256] [--steps N] [--interp] [--compile] [--captured]
        [--checkpointing]

Random weights and tokens: throughput does not depend on what the model knows.
`--interp` adds phase-1 rows (alpha < 1: both KV sets are computed). `--compile` times every
MELT row again with the layer step compiled (recipe `compile: true`; its compilation falls in
the untimed warm-up step) and fits the fixed cost per chunk of both, before and after. `--captured` does the
same with each (layer, loop) step captured whole (recipe `compile: captured`), which always recomputes its
forward in its backward: `--checkpointing` gives the other rows activation checkpointing too.
"""

from __future__ import annotations

import copy
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _args import Parser, device as a_device, whole, wholes  # noqa: E402

from melt_eval.modeling import LoopLMConfig, LoopLMForCausalLM, MeltForCausalLM  # noqa: E402
from melt_eval.training.config import Recipe  # noqa: E402
from melt_eval.training.runner import forward_objective, param_groups  # noqa: E402

PRESETS = {
    # the registry's tiny-random-ouro shape
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2, head_dim=64, vocab_size=512),
    "small": dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8, head_dim=64, vocab_size=8192),
    # Ouro-1.4B / MELT-1.6B (needs a GPU)
    "ouro-1.4b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=24, num_attention_heads=16, head_dim=128, vocab_size=49152),
}


def build(preset: str, device, dtype):
    config = LoopLMConfig(**PRESETS[preset], total_ut_steps=4, max_position_embeddings=65536, rope_theta=10000.0)
    torch.manual_seed(0)
    with torch.device(device):
        looplm = LoopLMForCausalLM(config)
    looplm.model.early_exit_gate.requires_grad_(False)
    melt = MeltForCausalLM.from_looplm(looplm, gate="elementwise", seed=0)
    melt.model.early_exit_gate.requires_grad_(False)
    return looplm.to(dtype), melt.to(dtype)


def measure(model, recipe: Recipe, batch: dict, steps: int, step_index: int, device) -> dict:
    model.train()
    opt = torch.optim.AdamW(param_groups(model, recipe), betas=(0.9, 0.95), weight_decay=1e-4)
    n = float(batch["loss_mask"][:, 1:].sum())
    tokens = batch["input_ids"].numel()

    def one():
        terms, _ = forward_objective(model, None, batch, recipe, step_index, n_loss_tokens=n, n_tokens=float(tokens))
        terms.total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    one()  # warm-up (allocations, kernels)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(steps):
        one()
    if device.type == "cuda":
        torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / steps
    out = {"step_s": dt, "tokens_per_s": tokens / dt}
    if device.type == "cuda":
        out["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    del opt
    return out


def fit_per_chunk(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares step_s = fixed + per_chunk x chunks; returns (per_chunk, fixed)."""
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    var = sum((x - mx) ** 2 for x, _ in points)
    per_chunk = sum((x - mx) * (y - my) for x, y in points) / var if var else float("nan")
    return per_chunk, my - per_chunk * mx


def main(argv=None) -> dict:
    ap = Parser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny model, short sequences, 2 timed steps")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    ap.add_argument("--preset", choices=list(PRESETS), default=None)
    ap.add_argument("--seq-len", type=whole(2, 65536), default=None, help="up to the models' 65,536 positions")
    ap.add_argument("--batch", type=whole(1), default=None)
    ap.add_argument("--chunks", type=wholes(1), default=None, help="comma-separated chunk sizes (C = L is always added)")
    ap.add_argument("--steps", type=whole(1), default=None)
    ap.add_argument("--interp", action="store_true", help="also time phase-1 steps (alpha < 1, both KV sets)")
    ap.add_argument("--compile", action="store_true", help="also time the MELT rows with the layer step torch.compile'd")
    ap.add_argument("--captured", action="store_true", help="also time the MELT rows with each (layer, loop) step captured whole")
    ap.add_argument("--checkpointing", action="store_true",
                    help="MELT with activation checkpointing (the captured step always recomputes; this makes the rows alike)")
    ap.add_argument("--device", type=a_device, default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    L = args.seq_len or (128 if args.quick else 512)
    chunks = list(args.chunks) if args.chunks else ([8, 32] if args.quick else [16, 64, 256])
    if not any(c < L for c in chunks):  # the per-chunk fit needs a second chunk count
        ap.error(f"--chunks needs a size below the sequence length {L}, got {','.join(map(str, chunks))}")

    device = torch.device(args.device)
    preset = args.preset or ("tiny" if args.quick or device.type == "cpu" else "small")
    B = args.batch or (2 if args.quick else 4)
    steps = args.steps or (2 if args.quick else 5)
    chunks = sorted({c for c in chunks if c < L}) + [L]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    looplm, melt = build(preset, device, dtype)
    if args.checkpointing:  # as the paper's recipes train; the compiled and captured copies inherit it
        melt.gradient_checkpointing_enable()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, PRESETS[preset]["vocab_size"], (B, L), generator=g).to(device)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids, dtype=torch.bool),
             "loss_mask": torch.ones_like(ids, dtype=torch.bool)}

    rows = []
    base = Recipe(kd=False, interpolation_steps=0, data=[{"source": "synthetic"}])
    rows.append({"model": "looplm", "chunk_size": None, "alpha": None, "compiled": False,
                 **measure(looplm, Recipe(**{**base.to_dict(), "target": "looplm"}), batch, steps, 0, device)})
    variants = [(False, melt)]
    if args.compile:
        compiled = copy.deepcopy(melt)
        compiled.model.compile_layer_step()
        variants.append((True, compiled))
    if args.captured:
        captured = copy.deepcopy(melt)
        captured.model.compile_captured_step()
        variants.append(("captured", captured))
    for is_compiled, model in variants:
        for c in chunks:
            for alpha, step_index in [(1.0, 0)] + ([(0.5, 1)] if args.interp else []):
                if is_compiled:
                    # each row compiles its own graphs in its warm-up step; dynamo's cache is per function across
                    # the rows, and past its recompile limit it would run the later rows' steps eagerly
                    torch._dynamo.reset()
                r = Recipe(**{**base.to_dict(), "chunk_size": c, "interpolation_steps": 0 if alpha == 1.0 else 2})
                rows.append({"model": "melt", "chunk_size": c, "alpha": alpha, "compiled": is_compiled,
                             **measure(model, r, batch, steps, step_index, device)})
    full = next(r for r in rows if r["model"] == "melt" and r["chunk_size"] == L and r["alpha"] == 1.0 and not r["compiled"])
    for r in rows:
        r["vs_parallel"] = r["tokens_per_s"] / full["tokens_per_s"]
    # step time = fixed + per_chunk x chunks, least squares over the alpha = 1 rows
    fits = {is_compiled: fit_per_chunk([(-(-L // r["chunk_size"]), r["step_s"]) for r in rows if r["model"] == "melt"
                                        and r["alpha"] == 1.0 and r["compiled"] == is_compiled])
            for is_compiled, _ in variants}
    per_chunk, fixed = fits[False]

    machine = (torch.cuda.get_device_name(device) if device.type == "cuda"
               else f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} threads")
    result = {"machine": machine, "preset": preset, "seq_len": L, "batch": B, "steps": steps, "checkpointing": args.checkpointing,
              "dtype": str(dtype).replace("torch.", ""), "loops": 4, "rows": rows,
              "per_chunk_s": per_chunk, "fixed_s": fixed}
    if args.compile:
        result["compiled_per_chunk_s"], result["compiled_fixed_s"] = fits[True]
    if args.captured:
        result["captured_per_chunk_s"], result["captured_fixed_s"] = fits["captured"]
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"training throughput: {preset} (T=4), B={B}, L={L}, {result['dtype']}, {machine}")
        print(f"{'model':<7} {'step':<8} {'C':>6} {'alpha':>5} {'tokens/s':>10} {'step s':>8} {'vs C=L':>7}"
              + ("  peak GiB" if device.type == "cuda" else ""))
        for r in rows:
            c = "-" if r["chunk_size"] is None else ("L" if r["chunk_size"] == L else str(r["chunk_size"]))
            a = "-" if r["alpha"] is None else f"{r['alpha']:.1f}"
            mode = "captured" if r["compiled"] == "captured" else "compiled" if r["compiled"] else "eager"
            line = f"{r['model']:<7} {mode:<8} {c:>6} {a:>5} {r['tokens_per_s']:>10.0f} {r['step_s']:>8.3f} {r['vs_parallel']:>6.2f}x"
            if "peak_gib" in r:
                line += f"  {r['peak_gib']:>8.2f}"
            print(line)
        print(f"step time fit: {result['fixed_s']:.3f} s + {per_chunk * 1e3:.1f} ms per chunk (MELT, alpha 1, eager)")
        if args.compile:
            print(f"step time fit: {result['compiled_fixed_s']:.3f} s + {result['compiled_per_chunk_s'] * 1e3:.1f} ms"
                  " per chunk (MELT, alpha 1, compiled)")
        if args.captured:
            print(f"step time fit: {result['captured_fixed_s']:.3f} s + {result['captured_per_chunk_s'] * 1e3:.1f} ms"
                  " per chunk (MELT, alpha 1, captured)")
        print("vs C=L: against the eager parallel (C = L) MELT step")
    return result


if __name__ == "__main__":
    main()
