"""Activation memory of chunk-wise MELT training: constant per token in L and in the chunk count.

For MELT (elementwise gate, tiny width) at C = L and C = L/20 and L in {400, 800, 1600}, one
training step (forward with the SFT objective, backward) is measured two ways:

- saved_bytes_per_token: the distinct tensors autograd saves for backward, counted exactly with
  `torch.autograd.graph.saved_tensors_hooks` (storages counted once, parameters left out);
- peak_rss_bytes: the peak resident memory of a child process that builds the model and runs
  the step (`ru_maxrss`), beside `base_rss_bytes`, the same child's resident memory before it.

Then projections for the paper's phase-1 and phase-2 steps (MELT-1.6B: Ouro-1.4B shape + elementwise
gates, L = 10,000, C = 500, fp32 weights under bf16 autocast as the runner trains, the frozen teacher
and all-loop KD, phase 2 with attention alignment): the saved activations are counted on real
autocast tensors at one and two layers and extrapolated (beside the meta-device count for bf16
activations), everything else is arithmetic stated beside it. `benchmarks/gpu.py` measures the
real step on a GPU.

    python benchmarks/train_memory.py [--quick] [--json] [--no-projection]
"""

from __future__ import annotations

import json
import platform
import resource
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from melt_eval.modeling import LoopLMConfig, LoopLMForCausalLM, MeltForCausalLM  # noqa: E402
from _args import Parser  # noqa: E402  (benchmarks/: the script's own folder)

TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2, head_dim=64, vocab_size=512)
OURO_1_4B = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=24, num_attention_heads=16, head_dim=128,
                 vocab_size=49152)


def build_melt(shape: dict, device="cpu", checkpointing=True) -> MeltForCausalLM:
    config = LoopLMConfig(**shape, total_ut_steps=4, max_position_embeddings=65536, rope_theta=1e6)
    torch.manual_seed(0)
    with torch.device(device):
        looplm = LoopLMForCausalLM(config)
    melt = MeltForCausalLM.from_looplm(looplm, gate="elementwise", seed=0).train()
    if checkpointing:
        melt.gradient_checkpointing_enable()
    return melt


def saved_bytes(model, fn) -> int:
    """Bytes of the distinct storages autograd saves while fn runs; parameters are not counted."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()} if model is not None else set()
    seen: dict[tuple, int] = {}

    def pack(t):
        s = t.untyped_storage()
        key = (t.device.type, s.data_ptr()) if t.device.type != "meta" else ("meta", id(s))
        if key[1] not in params:
            # the meta device cannot tell a shared storage apart: each save is counted (an upper bound)
            seen[key] = (t.numel() * t.element_size()) if t.device.type == "meta" else s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(seen.values())


def sft_step(model, ids, chunk):
    from melt_eval.training.losses import sft_loss_from_hidden

    out = model(ids, chunk_size=chunk, compute_logits=False)
    mask = torch.ones_like(ids, dtype=torch.bool)
    return sft_loss_from_hidden(model.lm_head, out.last_hidden_state, ids, mask)


def child(seq_len: int, chunk: int) -> dict:
    """Runs in a fresh process: one step, its saved bytes and the process's peak RSS."""
    torch.set_num_threads(1)
    model = build_melt(TINY)
    ids = torch.randint(0, TINY["vocab_size"], (1, seq_len), generator=torch.Generator().manual_seed(0))
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    loss = None

    def step():
        nonlocal loss
        loss = sft_step(model, ids, chunk)
        return loss

    saved = saved_bytes(model, step)
    loss.backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"seq_len": seq_len, "chunk_size": chunk, "saved_bytes_per_token": saved / seq_len,
            "peak_rss_bytes": peak, "base_rss_bytes": base}


def measure(seq_len: int, chunk: int) -> dict:
    code = f"import json, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import train_memory as m; print(json.dumps(m.child({seq_len}, {chunk})))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def saved_under_autocast(phase: int, seq_len: int = 64, chunk: int = 16) -> float:
    """Saved activation bytes per token of the paper-width model as the runner trains it: fp32 weights
    under bf16 autocast, where the residual stream stays fp32 (a bf16 meta-device count misses that).
    Counted on real CPU tensors at N = 1 and 2 layers (vocabulary 512: the embedding saves only ids) and
    extrapolated to N = 24 as a per-loop part plus a per-layer part; per token it is constant in L."""
    per_token = {}
    for n in (1, 2):
        model = build_melt({**OURO_1_4B, "num_hidden_layers": n, "vocab_size": 512})
        ids = torch.randint(0, 512, (1, seq_len), generator=torch.Generator().manual_seed(0))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            per_token[n] = saved_bytes(model, lambda: model(
                ids, chunk_size=chunk, alpha=0.5 if phase == 1 else 1.0, output_loop_states=True,
                output_attn_outputs=phase == 2, compute_logits=False).hidden_states) / seq_len
        del model
    per_layer = per_token[2] - per_token[1]
    return per_token[1] + (OURO_1_4B["num_hidden_layers"] - 1) * per_layer


def meta_forward(phase: int, seq_len: int, chunk: int, checkpointing: bool) -> tuple[int, int]:
    """(saved bytes, KV buffer bytes) of the bf16 model's training forward on the meta device (shapes only)."""
    from melt_eval.modeling.kv_cache import TrainingKVBuffer

    model = build_melt(OURO_1_4B, device="meta", checkpointing=checkpointing).to(torch.bfloat16)
    ids = torch.zeros(1, seq_len, dtype=torch.long, device="meta")
    buffers = {}
    real_init = TrainingKVBuffer.__init__

    def spy(self, capacity):  # keep a handle on the step's KV buffer to read its size
        real_init(self, capacity)
        buffers["store"] = self

    TrainingKVBuffer.__init__ = spy
    try:
        # phase 1 at alpha < 1 (its transition): both KV sets, the larger case; loop states for KD
        saved = saved_bytes(None, lambda: model(ids, chunk_size=chunk, alpha=0.5 if phase == 1 else 1.0,
                                                output_loop_states=True, output_attn_outputs=phase == 2,
                                                compute_logits=False).hidden_states)
    finally:
        TrainingKVBuffer.__init__ = real_init
    return saved, buffers["store"].nbytes


def projection(phase: int = 1, seq_len=10_000, chunk=500, checkpointing=True) -> dict:
    """A phase-1 or phase-2 step of MELT-1.6B on one GPU as `melt-eval train` runs it under bf16 (fp32 weights
    and AdamW, bf16 autocast, frozen bf16 teacher, all-loop KD; phase 2 adds attention alignment): saved
    activations counted (meta device for bf16 activations, real autocast tensors for the runner's), the
    rest by arithmetic stated beside it."""
    cfg = build_melt(OURO_1_4B, device="meta", checkpointing=False).config
    d, T, N = cfg.hidden_size, cfg.total_ut_steps, cfg.num_hidden_layers
    meta_saved, kv_buffer = meta_forward(phase, seq_len, chunk, checkpointing)
    autocast_saved = saved_under_autocast(phase) * seq_len
    model = build_melt(OURO_1_4B, device="meta", checkpointing=False)
    params = sum(p.numel() for p in model.parameters())
    teacher_params = params - sum(p.numel() for p in model.gate_parameters())
    bf16, fp32 = 2, 4
    keys = "T x N mixed" if phase == 1 else "N shared"
    parts = {
        "saved_activations (fp32 weights under bf16 autocast: real tensors at N = 1, 2, extrapolated)": autocast_saved,
        f"kv_buffers (bf16 entries, {keys})": kv_buffer,
        "kv_gradient_buffers (fp32, allocated in backward)": 2 * kv_buffer,
        "weights fp32 + grads fp32 + AdamW fp32 (4 + 4 + 8 bytes/param)": params * 16,
        "teacher weights bf16": teacher_params * bf16,
        "teacher loop hidden states for KD (T x L x d, bf16)": T * seq_len * d * bf16,
        "student loop hidden states for KD (T x L x d, fp32 under autocast)": T * seq_len * d * fp32,
        "KD block: student + teacher fp32 logits, log-softmaxes, grad (6 x 2^25 x 4 bytes)": 6 * 2**25 * 4,
    }
    if phase == 2:
        parts.update({
            "student attention outputs kept for alignment (N x T x L x d, bf16)": N * T * seq_len * d * bf16,
            "teacher attention outputs (N x T x L x d, bf16)": N * T * seq_len * d * bf16,
            "alignment: one (layer, loop) fp32 difference at a time (checkpointed; L x d x 4 bytes x 2)": 2 * seq_len * d * fp32,
        })
    return {"shape": "MELT-1.6B (Ouro-1.4B + elementwise gates)", "phase": phase, "seq_len": seq_len, "chunk_size": chunk,
            "activation_checkpointing": checkpointing, "params": params, "parts_bytes": parts,
            "total_bytes": sum(parts.values()), "saved_bytes_per_token": autocast_saved / seq_len,
            "saved_bytes_per_token_bf16_activations (meta device)": meta_saved / seq_len}


def main(argv=None):
    ap = Parser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="L in {400, 800} only, no projection")
    ap.add_argument("--json", action="store_true", help="print the measured rows as a JSON list")
    ap.add_argument("--no-projection", action="store_true", help="skip the paper-shape projection")
    args = ap.parse_args(argv)
    lengths = [400, 800] if args.quick else [400, 800, 1600]
    rows = [measure(L, C) for L in lengths for C in (L, L // 20)]
    projections = [] if args.no_projection or args.quick else [projection(phase=1), projection(phase=2)]
    if args.json:
        print(json.dumps(rows + [{"projection": p} for p in projections], indent=1))
        return rows
    print(f"training activation memory: MELT tiny (d=128, N=2, T=4), B=1, float32, activation checkpointing, "
          f"{platform.machine()} CPU")
    print(f"{'L':>6} {'C':>6} {'saved B/token':>14} {'vs C=L':>7} {'peak RSS MiB':>13} {'base RSS MiB':>13}")
    by_len = {r["seq_len"]: r for r in rows if r["chunk_size"] == r["seq_len"]}
    for r in rows:
        ratio = r["saved_bytes_per_token"] / by_len[r["seq_len"]]["saved_bytes_per_token"]
        print(f"{r['seq_len']:>6} {r['chunk_size']:>6} {r['saved_bytes_per_token']:>14,.0f} {ratio:>6.2f}x "
              f"{r['peak_rss_bytes'] / 2**20:>13,.1f} {r['base_rss_bytes'] / 2**20:>13,.1f}")
    for proj in projections:
        print(f"\nprojection: {proj['shape']}, phase {proj['phase']}, L = {proj['seq_len']:,}, C = {proj['chunk_size']}, "
              f"with the teacher and KD, B = 1, fp32 weights under bf16 autocast, activation checkpointing")
        for name, b in proj["parts_bytes"].items():
            print(f"  {b / 1e9:>7.2f} GB  {name}")
        print(f"  {proj['total_bytes'] / 1e9:>7.2f} GB  total (80 GB H100: {'fits' if proj['total_bytes'] < 80e9 else 'does not fit'})")
    return rows


if __name__ == "__main__":
    main()
