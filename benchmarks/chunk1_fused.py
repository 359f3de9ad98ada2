"""What a chunk-1 MELT training step would gain from one compiled function per token (measured, not added).

The demo's MELT runs train with chunk 1 (exact MELT: each reply token runs its T loops before the next
one), and at the tiny size a step is thousands of small operations: the training forward
(`MeltForCausalLM.forward` over `TrainingKVBuffer`) pays Python, dispatch and autograd bookkeeping per
(layer, loop) and per token. This script times, in one run, that real forward against a fused
alternative that processes a token's whole chunk, every loop and layer, in one function:

    per (layer, loop):  a = input_layernorm(x); q = RoPE(q_proj(a)); h = gate_update(h, a)
                        k, v = RoPE(k_proj(h)), v_proj(h)
                        attention over [the earlier tokens' final k, v (a [B, KVH, L, hd] tensor padded to
                        L, masked past the token), the chunk's own k, v (causally)]
                        x = residual + MLP (the model's own `attention_residual_and_mlp`)

with the earlier tokens' entries as ordinary autograd tensors (their padded copies are saved per token,
O(L^2) memory: fine at the demo's L = 112, not at the paper's 10K, which is why the real forward reads
its prefix in place). The fused function is timed eager and under torch.compile (static shapes: one
compile for the one-token chunk; the prompt, one chunk, runs eager), beside the real forward with each
layer step's pure parts compiled (the recipe option `compile: true`). The loss and the gradients of
every parameter are checked against the real forward first, so the timings compare the same step.

    python benchmarks/chunk1_fused.py [--batch 16] [--seq-len 112] [--prompt 19] [--steps 3] [--json]

Random weights and tokens, alpha = 1, the element-wise gate, the tiny preset (the demo's shape), one thread.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_throughput import build  # noqa: E402

from melt_eval.modeling.looplm import attention_residual_and_mlp  # noqa: E402
from melt_eval.modeling.melt import gate_update  # noqa: E402


def fused_chunk(model, x, cos, sin, prefix, valid):
    """All T loops over one chunk of c tokens. x [B, c, d]; prefix[i] = (k, v) [B, KVH, L, hd], the final
    entries of the earlier tokens (zeros where `valid` [L] is False). Returns norm(h_T) [B, c, d] and the
    chunk's final (k, v) per layer."""
    m = model.model
    n_layers, loops = len(m.layers), model.config.total_ut_steps
    c = x.shape[1]
    own_causal = torch.ones(c, c, dtype=torch.bool, device=x.device).tril()
    states, finals = [None] * n_layers, [None] * n_layers
    for t in range(loops):
        for i, layer in enumerate(m.layers):
            a = layer.input_layernorm(x)
            q = layer.self_attn.query(a, cos, sin)  # [B, H, c, hd]
            h = a if t == 0 else gate_update(layer.melt_gate, states[i], a, t + 1)[0]
            states[i] = h
            k, v = layer.self_attn.key_value(h, cos, sin)  # [B, KVH, c, hd]
            pk, pv = prefix[i]
            scale = q.shape[-1] ** -0.5
            s_prefix = (q @ pk.transpose(-1, -2) * scale).masked_fill(~valid, float("-inf"))  # [B, H, c, L]
            s_own = (q @ k.transpose(-1, -2) * scale).masked_fill(~own_causal, float("-inf"))  # [B, H, c, c]
            w = torch.softmax(torch.cat([s_prefix, s_own], dim=-1), dim=-1)
            heads = w[..., : pk.shape[2]] @ pv + w[..., pk.shape[2] :] @ v
            x, _ = attention_residual_and_mlp(layer, x, heads)
            finals[i] = (k, v)
        x = m.norm(x)
    return x, finals


def fused_forward(model, ids, prompt: int, token_step) -> torch.Tensor:
    """The last loop's hidden state [B, L, d]: the prompt as one chunk (eager), then one token at a time."""
    m = model.model
    B, L = ids.shape
    x = m.embed_tokens(ids)
    cos, sin = m.rotary_emb(torch.arange(L).expand(B, L), x.dtype)
    kvh, hd = model.config.num_key_value_heads, model.config.head_dim
    empty = x.new_zeros(B, kvh, L, hd)
    out, finals = fused_chunk(model, x[:, :prompt], cos[:, :, :prompt], sin[:, :, :prompt],
                              [(empty, empty)] * len(m.layers), torch.zeros(L, dtype=torch.bool))
    hidden = [out]
    keys = [[k] for k, _ in finals]
    values = [[v] for _, v in finals]
    for n in range(prompt, L):
        prefix = [(F.pad(torch.cat(ks, 2), (0, 0, 0, L - n)), F.pad(torch.cat(vs, 2), (0, 0, 0, L - n)))
                  for ks, vs in zip(keys, values)]
        out, finals = token_step(model, x[:, n : n + 1], cos[:, :, n : n + 1], sin[:, :, n : n + 1], prefix,
                                 torch.arange(L) < n)
        hidden.append(out)
        for i, (k, v) in enumerate(finals):
            keys[i].append(k)
            values[i].append(v)
    return torch.cat(hidden, dim=1)


def loss_of(model, hidden, ids, prompt):
    logits = model.lm_head(hidden[:, prompt - 1 : -1])  # predictions of the reply tokens
    return F.cross_entropy(logits.flatten(0, 1), ids[:, prompt:].flatten())


def step(model, ids, prompt, forward) -> tuple[float, float]:
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    loss = loss_of(model, forward(), ids, prompt)
    loss.backward()
    return time.perf_counter() - t0, loss.item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=112)
    ap.add_argument("--prompt", type=int, default=19)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per row (best is reported), after one warm-up")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    _, model = build("tiny", "cpu", torch.float32)
    model.train()
    assert model.config.num_key_value_heads == model.config.num_attention_heads, "the sketch has no GQA"
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq_len), generator=torch.Generator().manual_seed(0))
    P = args.prompt

    def real(m):
        return lambda: m(ids, chunk_size=1, first_chunk=P, compute_logits=False).last_hidden_state

    compiled_steps = copy.deepcopy(model)  # the recipe option `compile: true`: each layer step's pure parts
    compiled_steps.model.compile_layer_step()
    compiled_chunk = torch.compile(fused_chunk, dynamic=False)
    rows = {"real forward (TrainingKVBuffer), eager": (model, real(model)),
            "real forward, layer steps compiled": (compiled_steps, real(compiled_steps)),
            "fused per-token chunk, eager": (model, lambda: fused_forward(model, ids, P, fused_chunk)),
            "fused per-token chunk, torch.compile": (model, lambda: fused_forward(model, ids, P, compiled_chunk))}

    # the same step: loss and every gradient against the real forward
    grads = {}
    for name, (m, fwd) in rows.items():
        t_first, loss = step(m, ids, P, fwd)
        grads[name] = (loss, {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}, t_first)
    ref_loss, ref_grads, _ = grads["real forward (TrainingKVBuffer), eager"]
    checks = {}
    for name, (loss, g, _) in grads.items():
        worst = max((g[n] - ref_grads[n]).abs().max().item() / (ref_grads[n].abs().max().item() or 1) for n in ref_grads)
        checks[name] = {"loss_diff": abs(loss - ref_loss), "max_rel_grad_diff": worst, "same_params": set(g) == set(ref_grads)}
        if abs(loss - ref_loss) > 1e-5 * abs(ref_loss) or worst > 1e-4 or set(g) != set(ref_grads):
            sys.exit(f"error: {name} does not compute the real forward's step ({checks[name]}); timings not comparable")

    load_start = os.getloadavg()
    times = {name: min(step(m, ids, P, fwd)[0] for _ in range(args.steps)) for name, (m, fwd) in rows.items()}
    base = times["real forward (TrainingKVBuffer), eager"]
    report = {
        "machine": f"{platform.machine()} CPU, {os.cpu_count()} cores, one torch thread",
        "shape": {"batch": args.batch, "seq_len": args.seq_len, "prompt": P, "chunks": 1 + args.seq_len - P},
        "load_average": {"start": load_start, "end": os.getloadavg()},
        "step_s": times, "vs_real": {k: v / base for k, v in times.items()},
        "first_step_s": {k: v[2] for k, v in grads.items()},  # the compiled row's includes compilation
        "checks": checks,
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"chunk-1 MELT training step, tiny, B={args.batch}, L={args.seq_len} (prompt {P} as one chunk), "
          f"{report['machine']}, load {load_start[0]:.2f} -> {report['load_average']['end'][0]:.2f}")
    print(f"{'forward':42} {'step s':>8} {'vs real':>8} {'first step s':>13} {'max rel grad diff':>18}")
    for name, t in times.items():
        print(f"{name:42} {t:8.3f} {t / base:7.2f}x {report['first_step_s'][name]:13.1f} "
              f"{checks[name]['max_rel_grad_diff']:18.1e}")


if __name__ == "__main__":
    main()
