"""Kernel ops of one decode token step, counted on the CPU: eager, compiled, and whether the compiled step is
one graph that never recompiles.

    python benchmarks/dispatch_decode.py [--json PATH]     (also `benchmarks/dispatch.py --sections decode`)

A decode step on a GPU is bound by the host when it issues more kernels than the bytes it reads can keep the
device busy for (issue 49: 147 ms a token step at 32K against 12 ms of bytes). Op counts are exact and the same
on any machine, so they are measured here, not timed. What is counted, for Ouro (per-loop cache) and MELT
(shared cache, element-wise gates) at tiny shapes in bf16 (the GPU's decode dtype), one padded batch row:

- eager: every ATen op that is not a view (`OpOverload.is_view`, `_unsafe_view`) under a TorchDispatchMode, for
  the engine's eager step (`DecodeStep` "eager": `run_chunk`, Python-int columns) and for the captured step's
  code run eagerly (`DeviceAddressedKV`: a device-side column, the whole static capacity under the mask).
  The ops inside RMSNorm modules are counted apart: on the CPU `F.rms_norm` decomposes into the same 8 ops
  as the module's own code, while on CUDA it is one fused kernel, so `eager_fused_norms` (the other ops plus
  one per norm) is what a GPU issues once the norms are fused.
- compiled: the launches of the inductor-compiled step on the CPU, read from the code inductor generates
  (`run_and_get_code`): every fused C++ kernel (`cpp_fused_*`) and every extern or fallback op
  (`extern_kernels.*`, `aten.*` / `torch.ops.*`) called by its `call()`. On CUDA those are Triton kernels and
  the same extern ops, replayed as one CUDA graph.
- per (layer, loop): the difference between models of 2 and 1 layers, divided by T = 4 (every loop of MELT
  but the first runs its gate, so this is the mean over the loops); per token step at the 1.4B shape: the
  tiny model's ops outside the layers plus 24 x 4 times that.
- graph breaks and recompiles of the compiled step across 64 positions (torch._dynamo's counters and a
  counting backend, as the position and column move).
"""

from __future__ import annotations

import collections
import json
import os
import platform
import re
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from _args import Parser, output_file  # noqa: E402

from melt_eval.generation import decode_step  # noqa: E402
from melt_eval.generation.decode_step import DecodeStep  # noqa: E402
from melt_eval.modeling import LoopLMConfig, LoopLMForCausalLM, MeltForCausalLM  # noqa: E402
from melt_eval.modeling.kv_cache import DeviceAddressedKV, StaticStore  # noqa: E402

DIMS = dict(hidden_size=128, intermediate_size=256, num_attention_heads=2, head_dim=64, vocab_size=512)
LOOPS = 4
PAPER_LAYERS = 24
ROWS, PAST, CAPACITY = 2, 8, 96  # row 1 is left-padded by 3 columns; 64 more positions fit
POSITIONS = 64
SHAPES = {**DIMS, "loops": LOOPS, "rows": ROWS, "past": PAST, "capacity": CAPACITY, "dtype": "bfloat16"}


def build(kind: str, layers: int) -> LoopLMForCausalLM:
    torch.manual_seed(0)
    model = LoopLMForCausalLM(LoopLMConfig(**DIMS, num_hidden_layers=layers, total_ut_steps=LOOPS))
    if kind == "melt":
        model = MeltForCausalLM.from_looplm(model, gate="elementwise", seed=0)
    return model.to(torch.bfloat16).eval().requires_grad_(False)  # as the native backend holds the model it evaluates


def wave(model) -> tuple[StaticStore, torch.Tensor]:
    """A wave's cache with PAST columns filled and its key mask (row 1 left-padded)."""
    cfg = model.config
    N = cfg.num_hidden_layers
    keys = list(range(N)) if isinstance(model, MeltForCausalLM) else [(i, t) for t in range(LOOPS) for i in range(N)]
    store = StaticStore(keys, batch=ROWS, kv_heads=cfg.num_key_value_heads, capacity=CAPACITY, head_dim=cfg.head_dim,
                        dtype=torch.bfloat16, device="cpu")
    g = torch.Generator().manual_seed(1)
    for kb, vb in store.buffers.values():
        kb[:, :, :PAST] = torch.randn(kb[:, :, :PAST].shape, generator=g)
        vb[:, :, :PAST] = torch.randn(vb[:, :, :PAST].shape, generator=g)
    store.length = PAST
    key_mask = torch.ones(ROWS, CAPACITY, dtype=torch.bool)
    key_mask[1, :3] = False
    return store, key_mask


def inputs(store) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.tensor([[3], [5]])
    return tokens, torch.tensor([[store.length], [store.length - 3]])


class OpCounter(TorchDispatchMode):
    """Non-view ATen ops, split into those issued inside an RMSNorm module and the rest."""

    def __init__(self) -> None:
        super().__init__()
        self.ops, self.norm_ops, self.norm_calls, self._depth = collections.Counter(), 0, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not (func.is_view or func is torch.ops.aten._unsafe_view.default):
            self.ops[str(func)] += 1
            self.norm_ops += self._depth > 0
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        def pre(module, args):
            if type(module).__name__ == "RMSNorm":
                self._depth += 1
                self.norm_calls += 1

        def post(module, args, out):
            if type(module).__name__ == "RMSNorm":
                self._depth -= 1

        self._hooks = [torch.nn.modules.module.register_module_forward_pre_hook(pre),
                       torch.nn.modules.module.register_module_forward_hook(post)]
        return super().__enter__()

    def __exit__(self, *exc):
        for h in self._hooks:
            h.remove()
        return super().__exit__(*exc)


@torch.no_grad()
def eager_count(kind: str, layers: int, captured: bool) -> dict:
    model = build(kind, layers)
    store, key_mask = wave(model)
    policy = model.make_policy(store)
    if captured:  # the captured step's own code (a device-side column, the whole capacity), run eagerly
        policy = DeviceAddressedKV(policy, torch.tensor([store.length]))
    step = lambda: decode_step._logits(model, policy, key_mask, None, *inputs(store))  # noqa: E731
    step()  # warm: first-call work aside
    store.length = PAST
    with OpCounter() as counter:
        step()
    total = sum(counter.ops.values())
    return {"ops": total, "norm_ops": counter.norm_ops, "norm_calls": counter.norm_calls,
            "fused_norms": total - counter.norm_ops + counter.norm_calls, "by_op": dict(counter.ops.most_common())}


CALL = re.compile(r"def call\((?:self, )?args\)")
LAUNCH = re.compile(r"^\s*(?:\w+(?:, \w+)* = )?(cpp_fused_\w+|extern_kernels\.\w+|aten\.\w+(?:\.\w+)?|torch\.ops\.\w+\.\w+(?:\.\w+)?)\(",
                    re.M)


@torch.no_grad()
def compiled_count(kind: str, layers: int) -> dict:
    """Launches of the inductor-compiled step, from the wrapper code inductor generates for it."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    model = build(kind, layers)
    store, key_mask = wave(model)
    step = DecodeStep(model, model.make_policy(store), key_mask, mode="compiled")
    t0 = time.perf_counter()
    _, codes = run_and_get_code(step, *inputs(store))
    compile_s = time.perf_counter() - t0
    calls = []
    for code in codes:
        start = CALL.search(code)
        if start is None:
            raise RuntimeError("inductor's generated code has no call(): the launch count needs updating for this torch")
        body = code[start.end():]
        end = re.search(r"^\s*return ", body, re.M)  # call() ends with its return
        calls += LAUNCH.findall(body[: end.start() if end else len(body)])
    kinds = collections.Counter("fused" if c.startswith("cpp_fused") else c for c in calls)
    return {"launches": len(calls), "fused_kernels": kinds.pop("fused", 0), "extern": dict(kinds.most_common()),
            "compile_s": compile_s}


@torch.no_grad()
def graph_stability(kind: str) -> dict:
    """Graph breaks and recompiles of the compiled step over POSITIONS positions (dynamo with a counting backend:
    what is traced, not how it is compiled, decides both)."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    counter = CompileCounter()
    model = build(kind, 1)
    store, key_mask = wave(model)
    step = DecodeStep(model, model.make_policy(store), key_mask, mode="compiled")
    step.fn = torch.compile(decode_step._logits, backend=counter, fullgraph=False, dynamic=False)
    tokens, pos = inputs(store)
    for _ in range(POSITIONS):
        tokens = step(tokens, pos).argmax(-1, keepdim=True)
        pos = pos + 1
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    return {"positions": POSITIONS, "graph_breaks": breaks, "frames_compiled": counter.frame_count,
            "recompiles": counter.frame_count - 1 - breaks}


def per_layer_loop(one: dict, two: dict, key: str) -> float:
    return (two[key] - one[key]) / LOOPS


def decode_section() -> dict:
    """Eager, captured-eager and compiled counts and graph stability for Ouro and MELT (`dispatch.py`'s "decode")."""
    models = {}
    for kind in ("ouro", "melt"):
        out = {}
        for path in ("eager", "captured_eager"):
            one, two = (eager_count(kind, n, captured=path != "eager") for n in (1, 2))
            per = {k: per_layer_loop(one, two, k) for k in ("ops", "norm_ops", "fused_norms")}
            outside = one["ops"] - LOOPS * per["ops"]
            out[path] = {"per_layer_loop": per, "outside_layers": outside,
                         "per_token_step_1_4b": outside + PAPER_LAYERS * LOOPS * per["ops"],
                         "by_op_per_layer_loop": {op: (two["by_op"].get(op, 0) - one["by_op"].get(op, 0)) / LOOPS
                                                  for op in two["by_op"] if two["by_op"].get(op, 0) != one["by_op"].get(op, 0)}}
        one, two = compiled_count(kind, 1), compiled_count(kind, 2)
        per = per_layer_loop(one, two, "launches")
        outside = one["launches"] - LOOPS * per
        out["compiled"] = {"per_layer_loop": per, "outside_layers": outside,
                           "per_token_step_1_4b": outside + PAPER_LAYERS * LOOPS * per,
                           "fused_kernels_per_layer_loop": per_layer_loop(one, two, "fused_kernels"),
                           "extern_at_2_layers": two["extern"], "compile_s": [one["compile_s"], two["compile_s"]]}
        out["stability"] = graph_stability(kind)
        models[kind] = out
        torch._dynamo.reset()
    return models


def main(argv=None) -> dict:
    ap = Parser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=output_file, default=None, help="write the counts here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # counts do not depend on threads; compilation is lighter on a shared machine
    t0 = time.perf_counter()
    doc = {"script": "benchmarks/dispatch_decode.py", "torch": torch.__version__, "machine": platform.processor() or
           platform.machine(), "load_avg_start": os.getloadavg(), "shapes": SHAPES, "models": decode_section()}
    doc.update(total_s=time.perf_counter() - t0, load_avg_end=os.getloadavg())
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"decode token step, kernel ops (torch {torch.__version__}, load {doc['load_avg_start'][0]:.2f} -> "
          f"{doc['load_avg_end'][0]:.2f}, {doc['total_s']:.0f} s)")
    print(f"{'model':<6} {'path':<16} {'per (layer, loop)':>18} {'norms fused':>12} {'per step at 1.4B':>17}")
    for kind, out in doc["models"].items():
        for path in ("eager", "captured_eager"):
            r = out[path]
            print(f"{kind:<6} {path:<16} {r['per_layer_loop']['ops']:>18.2f} {r['per_layer_loop']['fused_norms']:>12.2f} "
                  f"{r['per_token_step_1_4b']:>17.0f}")
        r = out["compiled"]
        print(f"{kind:<6} {'compiled':<16} {r['per_layer_loop']:>18.2f} {'':>12} {r['per_token_step_1_4b']:>17.0f}")
        s = out["stability"]
        print(f"{kind:<6} over {s['positions']} positions: {s['graph_breaks']} graph breaks, {s['recompiles']} recompiles")
    return doc


if __name__ == "__main__":
    main()
