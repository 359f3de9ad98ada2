"""Every GPU figure of the harness from one prepared run: MELT training and decoding at the paper's shape.

    python benchmarks/gpu.py [--quick] [--json PATH] [--budget-s S] [--device cuda|cpu] [--only M1,M2]

A GPU is lent for minutes, so this script is ready before one is. Each measure runs in its own
process (`--measure NAME`, started by the parent), which first checks that the device's memory is
free: the first H100 run showed that a measure's model, optimiser and KV store outlive it in one
process (75.5 GB still allocated when the next measure started, so every later one ran out of
memory). The parent gives each measure a slot of seconds (`SLOTS`, at most what is left of the
budget), kills a measure that overruns it, and writes the JSON after every result (a run cut short
still returns its figures). The slots add up to the 420 s budget, so the whole run stays within 7 min.

1. phase1_step: one phase-1 optimiser step of MELT-1.6B (Ouro-1.4B shape, random weights,
   elementwise gates), L = 10,000, C = 500, alpha 0.5 (both KV sets), all-loop KD against the frozen
   bf16 teacher, activation checkpointing, B = 1, AdamW: the runner's set-up (fp32 weights under
   bf16 autocast). Peak allocated/reserved memory, tokens/s over the timed steps after a warm-up, the
   same for the parallel C = L pass, their ratio and the ratio to the paper's tokens/s per GPU. If
   L = 10,000 does not fit, the largest L at C = 500 that does. First, `prefix_attention_check`: the
   chunk attention's backward from the flash kernel's saved log-sum-exp against the recomputing one
   (same bits expected); if it fails, the step is timed with the recomputing backward, and the JSON says so.
2. decode: the native engine's eager decode step (the engine's `run_chunk` over its static cache, the
   engine's attention kernels and key mask) at the 1.4B shape, Ouro against MELT, the cache filled
   to 4K and 32K tokens (its contents do not change the work): 16 samples run in waves that fit a
   40 GiB cache budget, tokens/s and the measured cache bytes; the largest batch each fits in 40 GiB
   (allocated to prove it); both at the same batch at 32K; bytes read per generated token against
   the measured device bandwidth (the roofline).
3. decode_graphed: the engine's captured decode step (`generation/decode_step.py`: static cache
   addressed by a device-side column, compiled with fullgraph, replayed as a CUDA graph) at 32K: Ouro
   at batch 1, MELT at batch 1 and at the largest batch in 40 GiB; compile + capture time apart.
4. chunk_overhead: phase-1 step time at L = 4,096 against the number of chunks, fitted as
   fixed + per-chunk (as benchmarks/train_throughput.py does on the CPU).
5. phase1_step_compiled: measure 1 with the compiled layer step (compilation timed apart). Last,
   because compilation time is the least predictable and the eager figures answer the aims.

Named only, with --only (outside the 7-minute default run):

- phase1_step_captured: measure 1 with `compile_captured_step`, each (layer, loop) step one graph forward and one
  for its recompute and backward (compilation timed apart);
- phase1_step_captured_graphed: the same, replayed as CUDA graphs (`cuda_graphs=True`);
- fsdp: `melt-eval train` under FSDP on one GPU
(Accelerate runs FSDP on accelerators only, so the CPU tests cannot; docs/results/2026-11-27-distributed.md):
`tiny-phase1` at alpha 1, 4 steps, launched plainly and with melt_eval/recipes/accelerate/fsdp.yaml
(`--num_processes 1`): the FSDP run's recorded layout, its loss and gradient norm at every step against the
plain run's (aim: <= 1e-5 relative), then the FSDP run killed (-9) after its step-2 checkpoint and resumed:
its final SHA256SUMS against the uninterrupted FSDP run's.

`--quick` runs every measure at tiny shapes on the CPU (or the given device) in a few minutes with
the same precision set-up: bf16 autocast, the same recipe and options (compiled with the `aot_eager`
backend, which traces as inductor does without generating code), so the CPU test exercises the GPU's
code path. On CUDA the training steps use SDPA's flash or memory-efficient kernels only, and every
timer synchronises the device.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import platform
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from melt_eval.modeling import LoopLMConfig, LoopLMForCausalLM, MeltForCausalLM  # noqa: E402
from melt_eval.modeling.kv_cache import StaticStore  # noqa: E402
from melt_eval.training import load_recipe  # noqa: E402
from melt_eval.training.config import Recipe  # noqa: E402
from melt_eval.training.runner import forward_objective, param_groups  # noqa: E402
from train_throughput import fit_per_chunk  # noqa: E402
from _args import Parser  # noqa: E402  (benchmarks/: the script's own folder)

# The paper's main run: 160M (phase 1) + 96M (phase 2) tokens in 130 h on 8 H100s = 1,040 GPU-hours.
PAPER_TOKENS_PER_S_PER_GPU = (160e6 + 96e6) / (1040 * 3600)
PHASE1_STEP = 250  # alpha = 250 / 500 = 0.5: both KV sets (the larger phase-1 case)
OURO_1_4B = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=24, num_attention_heads=16, head_dim=128,
                 vocab_size=49152)
TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2, head_dim=64, vocab_size=512)
MEASURES = ("phase1_step", "decode", "decode_graphed", "chunk_overhead", "phase1_step_compiled")
# Seconds each measure may take at most, its process start-up included (the first H100 run took 109 s for
# phase1_step, 24 s for decode and 122 s for chunk_overhead): they add up to the default budget, and a
# measure cuts its own work short (its Clock) before the parent would kill it.
OPT_IN = ("fsdp", "phase1_step_captured", "phase1_step_captured_graphed")  # run only when named with --only
SLOTS = {"phase1_step": 120, "decode": 40, "decode_graphed": 110, "chunk_overhead": 60, "phase1_step_compiled": 90,
         "fsdp": 240, "phase1_step_captured": 150, "phase1_step_captured_graphed": 150}
# What a fresh process may already hold on the device: its own CUDA context (about 0.5 GiB on an H100).
CONTEXT_SLACK = 2 * 2**30
GiB = 2**30


@dataclass(frozen=True)
class Shapes:
    model: dict
    seq_len: int
    chunk: int
    timed_steps: int
    fallback_lengths: tuple[int, ...]  # tried, longest first, when seq_len does not fit
    decode_contexts: tuple[int, ...]
    decode_samples: int
    decode_new: int
    cache_budget: int
    overhead_len: int
    overhead_chunks: tuple[int, ...]
    compile_backend: str


FULL = Shapes(OURO_1_4B, 10_000, 500, 2, (8_000, 6_000, 4_000, 2_000, 1_000), (4_096, 32_768), 16, 16, 40 * GiB,
              4_096, (4_096, 2_048, 1_024, 512, 256), "inductor")
QUICK = Shapes(TINY, 128, 32, 2, (64,), (128, 512), 8, 4, 4 * 2**20, 128, (128, 64, 32), "aot_eager")


# --- set-up -------------------------------------------------------------------------------------------


class Clock:
    """Wall time with the device synchronised at both ends, and a deadline."""

    def __init__(self, device: torch.device, budget_s: float) -> None:
        self.device, self.start, self.budget_s = device, time.perf_counter(), budget_s

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def now(self) -> float:
        self.sync()
        return time.perf_counter()

    def left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.start)


class Report:
    """The JSON document, written atomically after every result."""

    def __init__(self, path: Path | None, header: dict) -> None:
        self.path, self.doc = path, {**header, "measures": {name: {"status": "not run"} for name in MEASURES}}

    def put(self, measure: str, **fields) -> None:
        self.doc["measures"].setdefault(measure, {}).update(fields)  # an opt-in measure joins when it starts
        self.save()

    def save(self) -> None:
        if self.path is None:
            return
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.doc, indent=1, default=str) + "\n")
        os.replace(tmp, self.path)


def header(device: torch.device, shapes: Shapes, args) -> dict:
    from melt_eval.provenance import git_state

    info = {"type": device.type, "cpu": platform.processor() or platform.machine()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(name=props.name, total_memory_bytes=props.total_memory, capability=f"{props.major}.{props.minor}",
                    multiprocessors=props.multi_processor_count)
    return {
        "script": "benchmarks/gpu.py", "quick": args.quick, "budget_s": args.budget_s,
        "started": datetime.now(timezone.utc).isoformat(timespec="seconds"), "load_avg_start": os.getloadavg(),
        "device": info, "shapes": asdict(shapes),
        "versions": {"torch": torch.__version__, "cuda": torch.version.cuda,
                     "cudnn": torch.backends.cudnn.version() if device.type == "cuda" else None,
                     "python": platform.python_version(), "code": git_state()},
    }


def build_pair(shape: dict, device: torch.device) -> tuple[MeltForCausalLM, LoopLMForCausalLM]:
    """(student fp32 with checkpointing, teacher bf16 frozen), as the runner holds them under bf16."""
    config = LoopLMConfig(**shape, total_ut_steps=4, max_position_embeddings=65536)
    torch.manual_seed(0)
    with torch.device(device):
        teacher = LoopLMForCausalLM(config)
    student = MeltForCausalLM.from_looplm(teacher, gate="elementwise", seed=0).train()
    student.model.early_exit_gate.requires_grad_(False)
    student.gradient_checkpointing_enable()
    teacher = teacher.to(torch.bfloat16).eval().requires_grad_(False)
    return student, teacher


def training_kernels(device: torch.device):
    if device.type != "cuda":
        return contextlib.nullcontext()
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION])


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def device_in_use(device: torch.device) -> int:
    """Bytes of the device's memory in use by anyone (this process's CUDA context included); 0 on the CPU."""
    if device.type != "cuda":
        return 0
    free_bytes, total = torch.cuda.mem_get_info(device)
    return total - free_bytes


def assert_device_free(device: torch.device, measure: str) -> int:
    """A measure starts on an empty device: what another process (an earlier measure that did not exit)
    still holds would turn this measure's figures into out-of-memory errors."""
    used = device_in_use(device)
    if used > CONTEXT_SLACK:
        raise RuntimeError(f"{measure}: {used / GiB:.1f} GiB of the device are in use at the start (more than this "
                           f"process's context); end the process holding them (nvidia-smi) and rerun")
    return used


# --- 1 and 3: training steps ------------------------------------------------------------------------------


class Trainer:
    """A phase-1 step as `melt-eval train` runs it under bf16: autocast forward, backward, clip, AdamW."""

    def __init__(self, shapes: Shapes, device: torch.device, clock: Clock) -> None:
        self.shapes, self.device, self.clock = shapes, device, clock
        self.student, self.teacher = build_pair(shapes.model, device)
        self.recipe = load_recipe("paper-phase1", overrides={"data": [{"source": "synthetic"}]})
        self.opt = torch.optim.AdamW(param_groups(self.student, self.recipe), betas=(0.9, 0.95), weight_decay=1e-4)

    def amp(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    def step(self, seq_len: int, chunk: int) -> float:
        g = torch.Generator().manual_seed(seq_len)
        ids = torch.randint(0, self.shapes.model["vocab_size"], (1, seq_len), generator=g).to(self.device)
        ones = torch.ones_like(ids, dtype=torch.bool)
        batch = {"input_ids": ids, "attention_mask": ones, "loss_mask": ones}
        recipe = Recipe(**{**self.recipe.to_dict(), "chunk_size": chunk})
        with training_kernels(self.device):
            with self.amp():
                terms, _ = forward_objective(self.student, self.teacher, batch, recipe, PHASE1_STEP, n_loss_tokens=seq_len,
                                             n_tokens=seq_len, teacher_autocast=self.amp)
            terms.total.backward()
        loss = float(terms.total.detach())
        torch.nn.utils.clip_grad_norm_(self.student.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss

    def timed(self, seq_len: int, chunk: int, steps: int) -> dict:
        """A warm-up step, then `steps` timed ones; peak memory over the timed steps."""
        t0 = self.clock.now()
        self.step(seq_len, chunk)
        warmup_s = self.clock.now() - t0
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        t0 = self.clock.now()
        losses = [self.step(seq_len, chunk) for _ in range(steps)]
        step_s = (self.clock.now() - t0) / steps
        row = {"seq_len": seq_len, "chunk_size": chunk, "chunks": math.ceil(seq_len / chunk), "warmup_s": warmup_s,
               "step_s": step_s, "tokens_per_s": seq_len / step_s, "loss": losses[-1], "timed_steps": steps,
               "load_avg": os.getloadavg()}
        if self.device.type == "cuda":
            row.update(peak_allocated_bytes=torch.cuda.max_memory_allocated(self.device),
                       peak_reserved_bytes=torch.cuda.max_memory_reserved(self.device))
        return row

    def try_timed(self, seq_len: int, chunk: int, steps: int) -> dict:
        try:
            return self.timed(seq_len, chunk, steps)
        except torch.OutOfMemoryError:
            pass  # handled below, outside the except block: its traceback holds the step's frames and graph
        # An error inside `opt.step()` leaves AdamW's state half-built (the first run's KeyError 'exp_avg_sq'):
        # start it afresh, as a first step would, with the gradients of the failed step dropped.
        self.opt.state.clear()
        self.opt.zero_grad(set_to_none=True)
        free(self.device)
        return {"seq_len": seq_len, "chunk_size": chunk, "oom": True}

    def largest_fitting(self, chunk: int) -> int | None:
        """The longest fallback length (a multiple of C, longest first) whose step fits."""
        for seq_len in self.shapes.fallback_lengths:
            if self.clock.left() < 30:
                return None
            if "oom" not in self.try_timed(seq_len, chunk, steps=1):
                return seq_len
        return None


def prefix_attention_check(device: torch.device) -> dict:
    """`_PrefixAttention`'s saved-log-sum-exp backward against its recomputing one, on this device, bf16
    heads of 128 after a 512-token prefix: which kernel ran, and whether output and gradients are the same
    bits (they should be: the same ops SDPA's autograd runs). Its CUDA branch is proved on the CPU only in
    its arguments (tests/test_train_memory.py); this is where its numbers are checked."""
    from melt_eval.modeling import kv_cache

    def run(c: int, saved_lse: bool):
        torch.manual_seed(0)
        past, store = 512, kv_cache.TrainingKVBuffer(capacity=512 + c)
        store.write("k", torch.randn(2, 1, 4, past, 128, device=device, dtype=torch.bfloat16), 0)
        q = torch.randn(1, 4, c, 128, device=device, dtype=torch.bfloat16, requires_grad=True)
        kv = torch.randn(2, 1, 4, c, 128, device=device, dtype=torch.bfloat16, requires_grad=True)
        real = kv_cache._flash_inputs
        kv_cache._flash_inputs = real if saved_lse else (lambda q, k, v: None)
        try:
            kernel = "flash, log-sum-exp saved" if real(q.detach(), *kv.detach()) is not None else "recomputed"
            out = kv_cache._PrefixAttention.apply(q, kv, torch.zeros((), device=device), store, "k", past)
            out.backward(torch.randn_like(out))
        finally:
            kv_cache._flash_inputs = real
        return kernel, [out.detach(), q.grad, kv.grad, store.grads["k"]]

    result = {}
    for c in (1, 64):
        try:
            kernel, got = run(c, True)
            _, want = run(c, False)
        except Exception as exc:  # reported; the step is then measured with the recomputing backward
            traceback.print_exc()
            result[f"c={c}"] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
            continue
        result[f"c={c}"] = {"kernel": kernel, "same_bits": all(torch.equal(g, w) for g, w in zip(got, want)),
                            "max_abs_diff": max(float((g.float() - w.float()).abs().max()) for g, w in zip(got, want))}
    return result


def phase1(report: Report, measure: str, shapes: Shapes, device: torch.device, clock: Clock, compiled: bool | str) -> None:
    """compiled: False (eager), True (`compile_layer_step`), "captured" (`compile_captured_step`: each (layer, loop)
    step whole, forward and recompute with backward) or "captured_graphed" (the same, replayed as CUDA graphs)."""
    trainer = Trainer(shapes, device, clock)
    check = prefix_attention_check(device)
    report.put(measure, prefix_attention_check=check)
    if not all(row.get("same_bits") for row in check.values()):
        # a faulty kernel path would sink the whole measure: time the step with the recomputing backward instead
        from melt_eval.modeling import kv_cache

        kv_cache._flash_inputs = lambda q, k, v: None
        report.put(measure, prefix_attention="recomputed in the backward (the check failed)")
    L, C = shapes.seq_len, shapes.chunk
    if compiled:
        model = trainer.student.model
        compile_step = (lambda **kw: model.compile_captured_step(cuda_graphs=compiled == "captured_graphed", **kw)
                        if compiled in ("captured", "captured_graphed") else model.compile_layer_step)
        if shapes.compile_backend == "inductor":
            compile_step()
        else:
            compile_step(backend=shapes.compile_backend)
        report.put(measure, compile_backend=shapes.compile_backend)
    chunked = trainer.try_timed(L, C, shapes.timed_steps)
    report.put(measure, chunked=chunked)
    if chunked.get("oom"):
        report.put(measure, largest_fitting_seq_len=trainer.largest_fitting(C))
        return
    if clock.left() < (shapes.timed_steps + 1) * chunked["step_s"] * 1.5 + chunked["warmup_s"]:
        report.put(measure, parallel={"skipped": "time budget"})
        return
    parallel = trainer.try_timed(L, L, shapes.timed_steps)
    report.put(measure, parallel=parallel)
    if not parallel.get("oom"):
        report.put(measure, chunked_vs_parallel=chunked["tokens_per_s"] / parallel["tokens_per_s"])
    report.put(measure, vs_paper_tokens_per_s_per_gpu=chunked["tokens_per_s"] / PAPER_TOKENS_PER_S_PER_GPU,
               paper_tokens_per_s_per_gpu=PAPER_TOKENS_PER_S_PER_GPU)


def chunk_overhead(report: Report, shapes: Shapes, device: torch.device, clock: Clock) -> None:
    trainer = Trainer(shapes, device, clock)
    L, points, rows = shapes.overhead_len, [], []
    for chunk in shapes.overhead_chunks:
        if rows and clock.left() < 3 * rows[-1]["step_s"] * 1.5:
            report.put("chunk_overhead", stopped="time budget")
            break
        row = trainer.timed(L, chunk, steps=2)
        rows.append(row)
        points.append((row["chunks"], row["step_s"]))
        report.put("chunk_overhead", rows=rows)
    if len(points) >= 2:
        per_chunk, fixed = fit_per_chunk(points)
        report.put("chunk_overhead", seq_len=L, fixed_s=fixed, per_chunk_s=per_chunk)


# --- 2: decoding -------------------------------------------------------------------------------------------


def measure_bandwidth(device: torch.device, clock: Clock) -> float:
    """Bytes per second of a device-to-device copy, counting bytes read and written."""
    n = (1 * GiB if device.type == "cuda" else 64 * 2**20) // 2
    src = torch.empty(n, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    reps = 10
    t0 = clock.now()
    for _ in range(reps):
        dst.copy_(src)
    dt = clock.now() - t0
    return 2 * src.nbytes * reps / dt


def cache_for(model, rows: int, capacity: int, device: torch.device) -> StaticStore:
    """The native engine's cache for `rows` sequences: one entry per (layer, loop) for Ouro, per layer for MELT."""
    cfg = model.config
    N, T = cfg.num_hidden_layers, cfg.total_ut_steps
    keys = list(range(N)) if isinstance(model, MeltForCausalLM) else [(i, t) for t in range(T) for i in range(N)]
    return StaticStore(keys, batch=rows, kv_heads=cfg.num_key_value_heads, capacity=capacity, head_dim=cfg.head_dim,
                       dtype=torch.bfloat16, device=device)


@torch.no_grad()
def decode_steps(model, rows: int, context: int, new: int, device: torch.device, clock: Clock) -> dict:
    """Seconds per decode step of `rows` sequences whose cache already holds `context` tokens."""
    from melt_eval.generation.engine import _DECODE_ATTENTION

    warmup = 2
    store = cache_for(model, rows, context + warmup + new, device)
    store.length = context
    policy = model.make_policy(store)
    key_mask = torch.ones(rows, store.capacity, dtype=torch.bool, device=device)  # equal-length rows: all real
    tokens = torch.zeros(rows, 1, dtype=torch.long, device=device)
    with sdpa_kernel(_DECODE_ATTENTION):
        for i in range(warmup + new):
            if i == warmup:
                t0 = clock.now()
            pos = torch.full((rows, 1), store.length, device=device)
            x, _ = model.model.run_chunk(tokens, pos, policy, key_mask=key_mask)
            tokens = model.lm_head(x[:, -1]).float().argmax(-1, keepdim=True)
        step_s = (clock.now() - t0) / new
    nbytes = store.nbytes
    del store, policy
    return {"rows": rows, "step_s": step_s, "cache_bytes": nbytes}


def bytes_read_per_step(model, rows: int, context: int) -> int:
    """A decode step reads every layer's weights once per loop, the LM head once, and at every (layer, loop)
    the cache of all earlier tokens: T x N x context entries per row for Ouro's per-loop caches and for
    MELT's shared one alike (MELT saves capacity, not reads)."""
    cfg = model.config
    T, N = cfg.total_ut_steps, cfg.num_hidden_layers
    layer_bytes = sum(p.numel() * p.element_size() for p in model.model.layers.parameters())
    head_bytes = model.lm_head.weight.numel() * model.lm_head.weight.element_size()
    entry_bytes = 2 * cfg.num_key_value_heads * cfg.head_dim * 2
    return T * layer_bytes + head_bytes + rows * T * N * context * entry_bytes


def decode(report: Report, shapes: Shapes, device: torch.device, clock: Clock) -> None:
    student, teacher = build_pair(shapes.model, device)
    models = {"ouro": teacher.eval(), "melt": student.to(torch.bfloat16).eval()}
    bandwidth = measure_bandwidth(device, clock)
    report.put("decode", bandwidth_bytes_per_s=bandwidth, cache_budget_bytes=shapes.cache_budget,
               samples=shapes.decode_samples, new_tokens=shapes.decode_new)
    S, new, budget = shapes.decode_samples, shapes.decode_new, shapes.cache_budget
    rows_out, capacity = [], {}
    for context in shapes.decode_contexts:
        for name, model in models.items():
            per_seq = cache_for(model, 1, context + new + 2, "meta").nbytes  # shapes only
            wave = min(S, budget // per_seq)
            row = {"model": name, "context": context, "cache_bytes_per_sequence": per_seq, "wave": wave}
            if wave == 0:
                rows_out.append({**row, "fits": False})
                continue
            waves = [wave] * (S // wave) + ([S % wave] if S % wave else [])
            timings = {w: decode_steps(model, w, context, new, device, clock) for w in sorted(set(waves))}
            total_s = sum(timings[w]["step_s"] * new for w in waves)
            tokens = S * new
            full = timings[wave]
            read = bytes_read_per_step(model, wave, context)
            row.update(waves=len(waves), tokens_per_s=tokens / total_s, measured_cache_bytes=full["cache_bytes"],
                       step_s=full["step_s"], bytes_read_per_token=read / wave,
                       roofline_step_s=read / bandwidth, bandwidth_fraction=(read / full["step_s"]) / bandwidth,
                       load_avg=os.getloadavg())
            rows_out.append(row)
            report.put("decode", rows=rows_out)
            free(device)
            if clock.left() < 20:
                report.put("decode", stopped="time budget")
                return
    long = max(shapes.decode_contexts)
    for name, model in models.items():  # the largest batch in the budget at the longest context, allocated
        per_seq = cache_for(model, 1, long + new + 2, "meta").nbytes
        most = budget // per_seq
        fits = None
        if most:
            try:
                store = cache_for(model, most, long + new + 2, device)
                fits = store.nbytes <= budget
                del store
            except torch.OutOfMemoryError:
                fits = False
            free(device)
        capacity[name] = {"max_batch": most, "allocated": fits}
    report.put("decode", capacity_at_longest_context=capacity,
               capacity_ratio=capacity["melt"]["max_batch"] / max(capacity["ouro"]["max_batch"], 1))
    same = max(1, min(capacity["ouro"]["max_batch"], S))  # equal batch: the most Ouro fits, up to S
    if clock.left() < 20:
        report.put("decode", equal_batch={"skipped": "time budget"})
        return
    eq = {name: decode_steps(model, same, long, new, device, clock) for name, model in models.items()}
    report.put("decode", equal_batch={"rows": same, "context": long, **{f"{n}_step_s": r["step_s"] for n, r in eq.items()},
                                      "melt_vs_ouro_tokens_per_s": eq["ouro"]["step_s"] / eq["melt"]["step_s"]})


@torch.no_grad()
def graphed_steps(model, rows: int, context: int, new: int, device: torch.device, clock: Clock, backend: str) -> dict:
    """`decode_steps` through the engine's captured step: compile (and, on CUDA, capture) on the first calls,
    timed apart, then `new` timed steps."""
    from melt_eval.generation.decode_step import DecodeStep

    warmup = 3  # the compiling call, the graph's recording call, one replay
    store = cache_for(model, rows, context + warmup + new, device)
    store.length = context
    key_mask = torch.ones(rows, store.capacity, dtype=torch.bool, device=device)
    mode = "graphed" if device.type == "cuda" else "compiled"
    step = DecodeStep(model, model.make_policy(store), key_mask, mode=mode, backend=backend)
    tokens = torch.zeros(rows, 1, dtype=torch.long, device=device)
    t0 = clock.now()
    for i in range(warmup + new):
        if i == warmup:
            compile_s, t0 = clock.now() - t0, clock.now()
        pos = torch.full((rows, 1), store.length, device=device)
        tokens = step(tokens, pos).argmax(-1, keepdim=True)
    step_s = (clock.now() - t0) / new
    nbytes = store.nbytes
    del step, store
    return {"rows": rows, "step_s": step_s, "compile_s": compile_s, "mode": mode, "cache_bytes": nbytes}


def decode_graphed(report: Report, shapes: Shapes, device: torch.device, clock: Clock) -> None:
    student, teacher = build_pair(shapes.model, device)
    # as the native backend holds the model it evaluates: nothing trains, so the captured step freezes the weights in
    models = {"ouro": teacher.eval(), "melt": student.to(torch.bfloat16).eval().requires_grad_(False)}
    bandwidth = measure_bandwidth(device, clock)
    long, new, budget = max(shapes.decode_contexts), shapes.decode_new, shapes.cache_budget
    backend = "inductor" if shapes.compile_backend == "inductor" else shapes.compile_backend
    report.put("decode_graphed", bandwidth_bytes_per_s=bandwidth, context=long, new_tokens=new, backend=backend)
    most = budget // cache_for(models["melt"], 1, long + new + 3, "meta").nbytes
    # the aims' rows first: Ouro at batch 1, MELT at the batch 40 GiB holds; MELT at batch 1 for the ratio last
    runs = [("ouro", 1), ("melt", max(1, min(most, shapes.decode_samples))), ("melt", 1)]
    rows_out = []
    for name, rows in runs:
        if rows_out and clock.left() < 1.5 * max(r["compile_s"] + new * r["step_s"] for r in rows_out) + 5:
            report.put("decode_graphed", stopped="time budget")
            break
        r = graphed_steps(models[name], rows, long, new, device, clock, backend)
        read = bytes_read_per_step(models[name], rows, long)
        rows_out.append({"model": name, "context": long, **r, "tokens_per_s": rows / r["step_s"],
                         "bytes_read_per_token": read / rows, "roofline_step_s": read / bandwidth,
                         "bandwidth_fraction": (read / r["step_s"]) / bandwidth, "load_avg": os.getloadavg()})
        report.put("decode_graphed", rows=rows_out)
        free(device)
    one = {r["model"]: r for r in rows_out if r["rows"] == 1}
    if len(one) == 2:
        report.put("decode_graphed", melt_vs_ouro_tokens_per_s_batch_1=one["ouro"]["step_s"] / one["melt"]["step_s"])


# --- FSDP (named only) -----------------------------------------------------------------------------------

FSDP_TRAIN = ["train", "--recipe", "tiny-phase1", "--from", "tiny-random-ouro", "--max-steps", "4", "--no-progress",
              "--set", "interpolation_steps=0", "--set", 'mixed_precision="no"', "--set", "save_every=2"]


def _train_cmd(out: Path, fsdp: bool, resume: bool = False) -> list[str]:
    launch = ([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(REPO / "melt_eval/recipes/accelerate/fsdp.yaml"), "--num_processes", "1", "--mixed_precision", "no"]
              if fsdp else [sys.executable])
    return launch + ["-m", "melt_eval.cli", *FSDP_TRAIN, "--output", str(out)] + (["--resume"] if resume else [])


def _steps(out: Path) -> list[tuple[float, float]]:
    from melt_eval.training.metrics import read_metrics

    return [(r["loss"], r["grad_norm"]) for _, r in read_metrics(out / "logs" / "metrics.jsonl")[0] if "grad_norm" in r]


def fsdp(report: Report, shapes: Shapes, device: torch.device, clock: Clock) -> None:
    """`melt-eval train` under FSDP (one GPU) against a plain run, and an FSDP kill -9 + --resume."""
    import tempfile

    if device.type != "cuda":
        report.put("fsdp", status="skipped", reason="Accelerate runs FSDP on GPUs only (the CPU tests cover the refusal)")
        return
    work = Path(tempfile.mkdtemp(prefix="melt-fsdp-"))
    env = {**os.environ, "MELT_EVAL_HOME": str(work / "home"), "HF_HUB_OFFLINE": "1"}
    runs = {}
    for name, use_fsdp in (("plain", False), ("fsdp", True)):
        t0 = time.perf_counter()
        proc = subprocess.run(_train_cmd(work / name, use_fsdp), env=env, capture_output=True, text=True,
                              timeout=max(10.0, clock.left()))
        if proc.returncode:
            raise RuntimeError(f"{name} run: exit {proc.returncode}: {(proc.stderr.strip().splitlines() or [''])[-1]}")
        meta = json.loads((work / name / "melt_eval_training.json").read_text())
        runs[name] = {"seconds": time.perf_counter() - t0, "layout": meta.get("layout"), "steps": _steps(work / name)}
    plain, sharded = runs["plain"]["steps"], runs["fsdp"]["steps"]
    worst = max(abs(a - b) / max(abs(a), 1e-30) for x, y in zip(plain, sharded) for a, b in zip(x, y))
    report.put("fsdp", runs=runs, worst_relative_difference=worst, parity_met=worst <= 1e-5 and len(plain) == len(sharded),
               distributed_type=(runs["fsdp"]["layout"] or {}).get("distributed_type"))
    # kill -9 once the step-2 checkpoint is complete, then --resume: the uninterrupted run's final sums?
    out = work / "fsdp-killed"
    proc = subprocess.Popen(_train_cmd(out, True), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    while proc.poll() is None and not (out / "checkpoints" / "step-000002" / "trainer_state.json").exists():
        time.sleep(0.2)
    os.killpg(proc.pid, 9)
    proc.wait()
    resumed = subprocess.run(_train_cmd(out, True, resume=True), env=env, capture_output=True, text=True,
                             timeout=max(10.0, clock.left()))
    same = resumed.returncode == 0 and (out / "SHA256SUMS").read_text() == (work / "fsdp" / "SHA256SUMS").read_text()
    report.put("fsdp", resume_exit=resumed.returncode, resumed_sums_equal_uninterrupted=same,
               resume_error=(resumed.stderr.strip().splitlines() or [""])[-1] if resumed.returncode else None)


# --- the run -----------------------------------------------------------------------------------------------


def aims(doc: dict, quick: bool) -> list[dict]:
    """The issue's aims beside what was measured (None where the measure did not run)."""
    m = doc["measures"]
    p1, dec = m["phase1_step"], m["decode"]
    chunked = p1.get("chunked", {})
    peak = chunked.get("peak_reserved_bytes")
    eq = dec.get("equal_batch", {})
    graphed = {(r["model"], r["rows"]): r for r in m["decode_graphed"].get("rows", [])}
    g_ouro = graphed.get(("ouro", 1), {}).get("bandwidth_fraction")
    g_melt = max((r["bandwidth_fraction"] for (n, b), r in graphed.items() if n == "melt" and b > 1), default=None)
    g_ratio = m["decode_graphed"].get("melt_vs_ouro_tokens_per_s_batch_1")

    def row(what, aim, value, ok):
        return {"measure": what, "aim": aim, "value": value, "met": None if value is None else bool(ok)}

    return [
        row("phase-1 step, L = 10K, C = 500, with teacher: peak reserved GB", "fits one 80 GB GPU",
            None if peak is None else peak / 1e9, peak is not None and peak < 80e9),
        row("C = 500 against parallel C = L (tokens/s)", ">= 0.7x", p1.get("chunked_vs_parallel"),
            (p1.get("chunked_vs_parallel") or 0) >= 0.7),
        row("phase 1 with teacher against the paper's 68 tokens/s/GPU", ">= 40x", p1.get("vs_paper_tokens_per_s_per_gpu"),
            (p1.get("vs_paper_tokens_per_s_per_gpu") or 0) >= 40),
        row("MELT decode capacity at the longest context, same cache budget", ">= 3.9x Ouro's batch",
            dec.get("capacity_ratio"), (dec.get("capacity_ratio") or 0) >= 3.9),
        row("MELT decode tokens/s at equal batch, longest context", ">= 0.9x Ouro's", eq.get("melt_vs_ouro_tokens_per_s"),
            (eq.get("melt_vs_ouro_tokens_per_s") or 0) >= 0.9),
        row("graphed decode, Ouro 32K batch 1: share of bandwidth", ">= 0.5", g_ouro, (g_ouro or 0) >= 0.5),
        row("graphed decode, MELT 32K, largest batch in 40 GiB: share of bandwidth", ">= 0.6", g_melt, (g_melt or 0) >= 0.6),
        row("graphed decode, MELT against Ouro tokens/s at batch 1, 32K", ">= 0.9x", g_ratio, (g_ratio or 0) >= 0.9),
        row("the whole script, s", "<= 420", doc.get("total_s"), (doc.get("total_s") or 1e9) <= 420),
    ] if not quick else [{**r, "met": None} for r in aims(doc, False)]


def print_table(doc: dict) -> None:
    dev = doc["device"].get("name") or doc["device"]["cpu"]
    print(f"\nbenchmarks/gpu.py on {dev}{' (quick: tiny shapes, no aims judged)' if doc['quick'] else ''}, "
          f"torch {doc['versions']['torch']}, CUDA {doc['versions']['cuda']}, {doc['total_s']:.0f} s, "
          f"load {doc['load_avg_start'][0]:.2f} -> {doc['load_avg_end'][0]:.2f}")
    for name, m in doc["measures"].items():
        print(f"  {name:<22} {m['status']:<10} {m.get('seconds', 0):6.1f} s  {m.get('error', '')}")
    print(f"\n{'measure':<68} {'aim':<22} {'value':>10}  met")
    for r in doc["aims"]:
        value = "-" if r["value"] is None else f"{r['value']:.3g}"
        met = "-" if r["met"] is None else ("yes" if r["met"] else "NO")
        print(f"{r['measure']:<68} {r['aim']:<22} {value:>10}  {met}")


RUNNERS = {
    "phase1_step": lambda r, sh, d, c: phase1(r, "phase1_step", sh, d, c, compiled=False),
    "decode": decode,
    "decode_graphed": decode_graphed,
    "chunk_overhead": chunk_overhead,
    "phase1_step_compiled": lambda r, sh, d, c: phase1(r, "phase1_step_compiled", sh, d, c, compiled=True),
    "fsdp": fsdp,
    "phase1_step_captured": lambda r, sh, d, c: phase1(r, "phase1_step_captured", sh, d, c, compiled="captured"),
    "phase1_step_captured_graphed": lambda r, sh, d, c: phase1(r, "phase1_step_captured_graphed", sh, d, c,
                                                               compiled="captured_graphed"),
}
STARTUP_S = 15  # a child's imports and device start-up, inside its slot


def run_measure(name: str, args, device: torch.device, shapes: Shapes) -> dict:
    """The child: one measure in this fresh process, its fields written to args.json as they come."""
    clock = Clock(device, args.budget_s)
    report = Report(args.json, {})
    report.doc["measures"] = {name: {"status": "running"}}
    try:
        report.put(name, pid=os.getpid(), device_in_use_at_start_bytes=assert_device_free(device, name))
        RUNNERS[name](report, shapes, device, clock)
        if report.doc["measures"][name].get("status") == "running":
            report.put(name, status="done")
    except Exception as exc:  # reported in the JSON; the parent goes on with the next measure
        traceback.print_exc()
        report.put(name, status="error", error=f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
    return report.doc["measures"][name]


def spawn(name: str, args, slot: float, part: Path) -> dict:
    """The parent: run one measure in its own process within `slot` seconds; what it wrote survives a crash."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--measure", name, "--json", str(part),
           "--budget-s", str(max(1.0, slot - STARTUP_S)), "--device", args.device] + (["--quick"] if args.quick else [])
    part.unlink(missing_ok=True)
    try:
        proc = subprocess.run(cmd, timeout=slot, stderr=subprocess.PIPE, text=True)
        tail = proc.stderr.strip().splitlines()[-1:] if proc.returncode else []
        sys.stderr.write(proc.stderr)
        failure = f"exit {proc.returncode}: {tail[0] if tail else ''}" if proc.returncode else None
    except subprocess.TimeoutExpired:
        failure = f"killed after its slot of {slot:.0f} s"
    fields = json.loads(part.read_text())["measures"][name] if part.is_file() else {}
    part.unlink(missing_ok=True)
    if failure or fields.get("status") in (None, "running"):
        fields.update(status="error", error=fields.get("error") or failure or "no result")
    return fields


def main(argv=None) -> dict:
    ap = Parser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="every measure at tiny shapes (the CPU test; a few minutes)")
    ap.add_argument("--json", type=Path, default=None, help="write the results here (rewritten after every result)")
    ap.add_argument("--budget-s", type=float, default=420.0, help="start nothing that would end after this (default 420)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--only", default=None, help=f"comma-separated subset of {','.join(MEASURES)}, or {','.join(OPT_IN)} (named only)")
    ap.add_argument("--measure", choices=MEASURES + OPT_IN, default=None, help=argparse.SUPPRESS)  # the child's one measure
    args = ap.parse_args(argv)
    if not (math.isfinite(args.budget_s) and args.budget_s >= 0):  # 0: every measure skipped, the report still written
        ap.error(f"--budget-s must be a finite number of seconds, 0 or more, got {args.budget_s}")
    if args.device.split(":")[0] not in ("cpu", "cuda") or args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error(f"--device {args.device!r} is no device here; pass cpu" + (" or cuda" if torch.cuda.is_available() else ""))
    unknown = [m for m in (args.only or "").split(",") if m and m not in MEASURES + OPT_IN]
    if unknown or args.only is not None and not any(args.only.split(",")):
        ap.error(f"--only names measures of {','.join(MEASURES + OPT_IN)}; got {args.only!r}")
    if args.json is not None and (args.json.is_dir() or not args.json.parent.is_dir()):
        ap.error(f"--json {args.json}: pass a file in an existing directory")
    device = torch.device(args.device)
    shapes = QUICK if args.quick else FULL
    if device.type == "cpu" and not args.quick:
        ap.error("the full shapes need a GPU; on the CPU use --quick")
    if device.type == "cpu":
        torch.set_num_threads(min(2, torch.get_num_threads()))
    if args.measure:
        return run_measure(args.measure, args, device, shapes)
    chosen = MEASURES if not args.only else tuple(m for m in MEASURES + OPT_IN if m in args.only.split(","))
    clock = Clock(device, args.budget_s)
    report = Report(args.json, header(device, shapes, args))
    # the least time each measure needs to be worth starting
    minimum = {"phase1_step": 10 if args.quick else 60, "decode": 20 if args.quick else 40, "decode_graphed": 30 if args.quick else 60,
               "chunk_overhead": 20 if args.quick else 45, "phase1_step_compiled": 30 if args.quick else 90,
               "fsdp": 5 if args.quick else 120, "phase1_step_captured": 30 if args.quick else 120,
               "phase1_step_captured_graphed": 30 if args.quick else 120}
    part = (args.json or Path(os.environ.get("TMPDIR", "/tmp")) / "gpu").with_suffix(".measure.json")
    for name in chosen:
        # --quick (the CPU test) has no GPU minutes to save: a measure may take what is left of the budget
        slot = clock.left() if args.quick else min(SLOTS[name], clock.left())
        if slot < minimum[name]:
            report.put(name, status="skipped", reason=f"time budget ({clock.left():.0f} s left)")
            continue
        t0 = time.perf_counter()
        report.put(name, status="running")
        report.doc["measures"][name] = spawn(name, args, slot, part)
        report.put(name, seconds=time.perf_counter() - t0)
    report.doc.update(total_s=time.perf_counter() - clock.start, load_avg_end=os.getloadavg())
    report.doc["aims"] = aims(report.doc, args.quick)
    report.save()
    print_table(report.doc)
    return report.doc


if __name__ == "__main__":
    main()
