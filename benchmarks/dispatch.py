"""Kernel ops the host dispatches per phase-1 training step, counted exactly on the CPU (issue 49).

    python benchmarks/dispatch.py [--json PATH] [--sections train,train_norms_fused,train_compiled,decode] [--layers 24]

On a GPU the chunk-wise step is bound by the host: each aten op is a kernel launch costing tens of
microseconds of Python and dispatcher time, whatever the chunk's length. The number of ops does not
depend on the widths, so it is counted on the CPU at tiny widths with the paper's depth (24 layers,
T = 4 loops) and the paper's phase-1 set-up: MELT with elementwise gates at alpha 0.5 (both KV sets), all-loop
KD against the frozen bf16 teacher, activation checkpointing, fp32 weights under bf16 autocast, gradient
clipping, AdamW built as `melt-eval train` builds it (`training.build.make_optimizer`, foreach on the CPU).

How ops are counted (`OpCounter`, a TorchDispatchMode): every aten op that reaches the dispatcher below
autograd, except those that only make a view or read metadata (`NO_KERNEL`: they launch nothing).
Phases are told apart by where the op is dispatched from: the teacher's forward, the student's forward
(inside a (layer, loop) step or around it), the backward (inside a checkpointed step's recompute, or the
rest), gradient clipping, the optimizer. `_local_scalar_dense` (`.item()`, `float()`, `.tolist()`) is
counted apart as well ("sync"): on CUDA each one on a device tensor is a host-device sync (AdamW's for-loop
path calls it on its CPU step counters, which costs no sync).

Per (chunk, layer, loop) is the slope in the number of chunks: the same step at L = 3 C and L = 4 C
(C = 16; the first chunk, with no prefix, and the last, with no commit, are in both: the slope is a middle
chunk's cost), divided by N T. It includes each chunk's share of what runs once per chunk or per loop (the
embedding, RoPE's tables, the loop's final norm, the commit), so it is given at the paper's N = 24. The fixed part per step is what runs once per step outside the student: the teacher's
forward, reading the loss, clipping and the optimizer (the student's own intercept, its first chunk without a
prefix and its last without a commit, is reported apart, `student_intercept`).

The compiled path is `compile_layer_step()` (recipe `compile: true`, inductor). Ops that run eagerly are
counted as above; inside a compiled graph the counter (`CompiledOpCounter`, which lets dynamo run its
graphs under the mode) sees only the graph's extern calls (matrix products, SDPA), and the fused C++
kernels inductor generates are counted from the generated code: each `cpp_fused_*` call in the graph's
wrapper is one launch (`FusedKernelCounter` wraps every compiled graph's `call` and adds its kernel calls
each time it runs). Graph breaks, unique graphs and recompiles
come from torch._dynamo's counters over the same steps (chunk indices 0..3 at one chunk length).

The "train_captured" section is `compile_captured_step()`: each (layer, loop) step, attention included, is one
compiled graph forward and one for its recompute and backward (`modeling/captured_step.py`), counted the same
way; its recompute runs inside the backward's graph, so it counts under "backward".

The "train_norms_fused" section is the eager step with every `F.rms_norm` counted as CUDA launches it, one
fused kernel each way (`FusedNorm`): on the CPU torch 2.13 runs a composite of about 20 ops that a GPU never
issues, so this is the count that stands for the GPU's.

The "decode" section is the token step's counts, per (layer, loop) and per token step, for Ouro and MELT,
eager and compiled, with graph breaks and recompiles over 64 positions: `benchmarks/dispatch_decode.py`
(which runs it alone too) says how they are counted.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import sys
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from _args import Parser, output_file, whole, wholes  # noqa: E402

from melt_eval.modeling import LoopLMConfig, LoopLMForCausalLM, MeltForCausalLM  # noqa: E402
from melt_eval.training import load_recipe  # noqa: E402
from melt_eval.training.build import allocate_optimizer_state, make_optimizer  # noqa: E402
from melt_eval.training.config import Recipe  # noqa: E402
from melt_eval.training.runner import forward_objective  # noqa: E402
from melt_eval.training.step import weight_casts_kept  # noqa: E402

aten = torch.ops.aten
# Ops that make a view or read metadata: no kernel runs on the device.
NO_KERNEL = {
    aten.view, aten._unsafe_view, aten.reshape, aten.as_strided, aten.t, aten.transpose, aten.permute, aten.expand,
    aten.slice, aten.select, aten.unsqueeze, aten.squeeze, aten.split, aten.split_with_sizes, aten.unbind,
    aten.chunk, aten.narrow, aten.detach, aten.alias, aten.lift_fresh, aten.unflatten, aten.flatten,
    aten._reshape_alias, aten.view_as_real, aten.view_as_complex, aten.diagonal, aten.is_same_size, aten.sym_size,
    aten.sym_stride, aten.sym_numel, aten.sym_storage_offset, aten.is_contiguous, aten.empty_like,
    aten.empty, aten.empty_strided, aten.new_empty, aten.new_empty_strided, aten.set_, aten.resize_,
}
SYNC = aten._local_scalar_dense

PHASE1_STEP = 250  # paper-phase1 at step 250: alpha 0.5, both KV sets (the larger phase-1 case)
SHAPE = dict(hidden_size=64, intermediate_size=96, num_attention_heads=2, num_key_value_heads=2, head_dim=32,
             vocab_size=256, total_ut_steps=4)
CHUNK = 16
CHUNKS = (3, 4)


class OpCounter(TorchDispatchMode):
    """Counts kernel ops by phase; `phase` is set by the code driving the step."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()  # (phase, op name) -> n
        self.phase = "other"
        self.in_layer = False
        self.paused = False

    def where(self) -> str:
        backward = torch._C._current_graph_task_id() != -1
        if backward:
            return "recompute" if self.in_layer else "backward"
        if self.phase == "student" and self.in_layer:
            return "forward"
        return self.phase

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        packet = func.overloadpacket
        if packet not in NO_KERNEL and not self.paused:
            self.counts[(self.where(), "sync" if packet is SYNC else packet.__name__)] += 1
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def uncounted(self):
        outer, self.paused = self.paused, True
        try:
            yield
        finally:
            self.paused = outer

    def add(self, phase: str, name: str, n: int) -> None:
        self.counts[(phase, name)] += n

    def by_phase(self) -> Counter:
        out: Counter = Counter()
        for (phase, _), n in self.counts.items():
            out[phase] += n
        return out


@contextlib.contextmanager
def causal_bias_outside_the_mode():
    """`causal_lower_right` builds a Tensor subclass, which cannot be created while a dispatch mode runs; it
    holds no data (two ints), so it is built with the mode set aside."""
    from torch.utils._python_dispatch import _disable_current_modes

    from melt_eval.modeling import kv_cache

    build_bias = kv_cache.causal_lower_right

    def outside(*args):
        with _disable_current_modes():
            return build_bias(*args)

    kv_cache.causal_lower_right = outside
    try:
        yield
    finally:
        kv_cache.causal_lower_right = build_bias


@contextlib.contextmanager
def counting_layer_steps(model, counter: OpCounter):
    """Mark the ops of every (layer, loop) step (`LoopLMModel._layer_step`, which checkpointing re-runs)."""
    inner = model.model
    step = inner._layer_step

    def marked(*args, **kwargs):
        outer, counter.in_layer = counter.in_layer, True
        try:
            return step(*args, **kwargs)
        finally:
            counter.in_layer = outer

    inner._layer_step = marked
    try:
        yield
    finally:
        del inner._layer_step


class FusedNorm(torch.autograd.Function):
    """`F.rms_norm` as CUDA runs it, for counting: one fused kernel forward (`_fused_rms_norm`) and one backward
    (`_fused_rms_norm_backward`). On the CPU torch 2.13 decomposes it into about 6 ops forward and 14 backward,
    which a GPU never launches; under this stand-in those run uncounted (the numbers are the composite's, under
    the forward's autocast state) and the counter adds one op each way."""

    counter: OpCounter | None = None
    composite = staticmethod(torch.nn.functional.rms_norm)

    @staticmethod
    def forward(ctx, x, weight, shape, eps):
        ctx.shape, ctx.eps = shape, eps
        ctx.autocast = (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))
        ctx.save_for_backward(x, weight)
        ctx.counter = counter = FusedNorm.counter
        with counter.uncounted():
            out = FusedNorm.composite(x, shape, weight, eps)
        counter.add(counter.where(), "rms_norm (fused)", 1)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        counter = ctx.counter
        with counter.uncounted(), torch.enable_grad(), torch.autocast("cpu", enabled=ctx.autocast[0],
                                                                      dtype=ctx.autocast[1]):
            inputs = [x.detach().requires_grad_()] + ([weight.detach().requires_grad_()] if weight is not None else [])
            out = FusedNorm.composite(inputs[0], ctx.shape, inputs[1] if weight is not None else None, ctx.eps)
            grads = torch.autograd.grad(out, inputs, grad)
        counter.add(counter.where(), "rms_norm_backward (fused)", 1)
        return grads[0], (grads[1] if weight is not None else None), None, None


@contextlib.contextmanager
def norms_fused(counter: OpCounter):
    """Count every `F.rms_norm` as the one fused kernel each way that CUDA launches (`FusedNorm`)."""
    FusedNorm.counter = counter

    def fused(x, normalized_shape, weight=None, eps=None):
        return FusedNorm.apply(x, weight, tuple(normalized_shape), eps)

    torch.nn.functional.rms_norm = fused
    try:
        yield
    finally:
        torch.nn.functional.rms_norm = FusedNorm.composite
        FusedNorm.counter = None


class CompiledOpCounter(OpCounter):
    """The same counter, which lets torch.compile run its compiled graphs (a mode that does not ignore compile
    internals makes dynamo fall back to eager): inside a graph it sees the extern calls (matrix products,
    SDPA) and not the fused kernels, which `FusedKernelCounter` adds."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True


class FusedKernelCounter:
    """Counts the fused kernels inductor's compiled graphs launch (`cpp_fused_*` / `triton_*` calls in each
    graph's generated `call`), by wrapping the generated module's `call` as inductor loads it. A module is
    loaded once per process, so its wrapper adds to whichever counter is current when it runs."""

    KERNEL = re.compile(r"^\s+(cpp_fused_\w+|triton_\w+)(?:\.run)?\(", re.M)
    current: OpCounter | None = None
    _installed = False

    @classmethod
    def install(cls) -> None:
        if cls._installed:
            return
        from torch._inductor import codecache

        loader = codecache.PyCodeCache.load_by_key_path

        def load(*args, **kwargs):
            mod = loader(*args, **kwargs)
            if getattr(mod, "_dispatch_counted", False) or not hasattr(mod, "call"):
                return mod
            source = Path(mod.__file__).read_text()
            body = source[source.find("def call("):]
            end = body.find("\ndef ", 1)
            launches = len(cls.KERNEL.findall(body if end < 0 else body[:end]))
            call = mod.call

            def counted_call(*a, **k):
                if cls.current is not None:
                    cls.current.add(cls.current.where(), "fused_kernel", launches)
                return call(*a, **k)

            mod.call = counted_call
            mod._dispatch_counted = True
            return mod

        codecache.PyCodeCache.load_by_key_path = load
        cls._installed = True


def build(layers: int):
    """(student fp32 with checkpointing, teacher bf16 frozen, recipe), as `melt-eval train` holds them under bf16."""
    config = LoopLMConfig(**SHAPE, num_hidden_layers=layers, max_position_embeddings=4096)
    torch.manual_seed(0)
    teacher = LoopLMForCausalLM(config)
    student = MeltForCausalLM.from_looplm(teacher, gate="elementwise", seed=0).train()
    student.model.early_exit_gate.requires_grad_(False)
    student.gradient_checkpointing_enable()
    teacher = teacher.to(torch.bfloat16).eval().requires_grad_(False)
    recipe = load_recipe("paper-phase1", overrides={"data": [{"source": "synthetic"}], "chunk_size": CHUNK,
                                                    "prompt_as_one_chunk": False})
    return student, teacher, recipe


def amp():
    return torch.autocast("cpu", dtype=torch.bfloat16)


def one_step(student, teacher, optimizer, recipe: Recipe, seq_len: int, counter: OpCounter | None) -> None:
    """A phase-1 optimiser step as the runner takes it: forward + objective, backward, clip, AdamW."""
    g = torch.Generator().manual_seed(seq_len)
    ids = torch.randint(0, SHAPE["vocab_size"], (1, seq_len), generator=g)
    ones = torch.ones_like(ids, dtype=torch.bool)
    batch = {"input_ids": ids, "attention_mask": ones, "loss_mask": ones}
    phase = (lambda name: setattr(counter, "phase", name)) if counter is not None else (lambda name: None)

    teacher_forward = teacher.forward

    def marked_teacher(*args, **kwargs):
        phase("teacher")
        try:
            return teacher_forward(*args, **kwargs)
        finally:
            phase("student")

    teacher.forward = marked_teacher
    try:
        phase("student")
        with weight_casts_kept():  # as the runner's micro-batch
            with amp():
                terms, out = forward_objective(student, teacher, batch, recipe, PHASE1_STEP, n_loss_tokens=seq_len,
                                               n_tokens=seq_len, teacher_autocast=amp)
            phase("backward")
            terms.total.backward()
            del out
        phase("loss_read")
        float(terms.total.detach())  # the runner reads the loss once per micro-batch
        phase("clip")
        torch.nn.utils.clip_grad_norm_(student.parameters(), recipe.grad_clip)
        phase("optimizer")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    finally:
        del teacher.forward
        phase("other")


def count_steps(layers: int, compiled: bool | str, fused_norms: bool = False) -> dict:
    """Op counts of one step at each number of chunks, after a warm-up step (compilation, optimizer state).
    compiled: True for `compile_layer_step`, "captured" for `compile_captured_step`."""
    student, teacher, recipe = build(layers)
    if compiled:
        # dynamo caches graphs per function, across every model of the process: graphs another model compiled
        # earlier (a test before this one) count toward its recompile limit, past which it runs the step eagerly
        torch._dynamo.reset()
        if compiled == "captured":
            student.model.compile_captured_step()
        else:
            student.model.compile_layer_step()
    optimizer = make_optimizer(student, recipe)
    allocate_optimizer_state(optimizer)
    if compiled:
        FusedKernelCounter.install()
    rows = {}
    from torch._dynamo.utils import counters

    def dynamo() -> dict:
        return {"unique_graphs": counters["stats"]["unique_graphs"], "graph_breaks": sum(counters["graph_break"].values()),
                "recompiles": sum(counters["recompiles"].values())}

    before = dynamo()
    for chunks in CHUNKS:  # warm-up: compile every chunk index's graphs, build the optimizer's state
        one_step(student, teacher, optimizer, recipe, chunks * CHUNK, None)
    warm = dynamo()
    for chunks in CHUNKS:
        counter = CompiledOpCounter() if compiled else OpCounter()
        FusedKernelCounter.current = counter
        try:
            norms = norms_fused(counter) if fused_norms else contextlib.nullcontext()
            with causal_bias_outside_the_mode(), counting_layer_steps(student, counter), norms, counter:
                one_step(student, teacher, optimizer, recipe, chunks * CHUNK, counter)
        finally:
            FusedKernelCounter.current = None
        rows[chunks] = counter
    after = dynamo()
    return {"rows": rows, "dynamo_warmup": {k: warm[k] - before[k] for k in warm},
            "dynamo_after_counted_steps": {k: after[k] - warm[k] for k in after}}


STEP_PHASES = ("teacher", "loss_read", "clip", "optimizer", "other")  # run once per step, outside the student


def summarise(rows: dict[int, OpCounter], layers: int, loops: int) -> dict:
    """Per (chunk, layer, loop) by phase (the slope in the chunks), and the fixed part per step: the phases
    outside the student's forward and backward (teacher, loss read, clipping, optimizer). The student's own
    intercept (its first chunk has no prefix to attend to, its last commits nothing; the loss over all tokens)
    is reported apart."""
    (k1, c1), (k2, c2) = sorted(rows.items())
    p1, p2 = c1.by_phase(), c2.by_phase()
    units = (k2 - k1) * layers * loops
    phases = sorted(set(p1) | set(p2))
    per_unit = {p: (p2[p] - p1[p]) / units for p in phases}
    intercept = {p: p1[p] - per_unit[p] * k1 * layers * loops for p in phases}
    ops1, ops2 = Counter(), Counter()
    for (_, name), n in c1.counts.items():
        ops1[name] += n
    for (_, name), n in c2.counts.items():
        ops2[name] += n
    per_unit_ops = {name: (ops2[name] - ops1[name]) / units for name in set(ops1) | set(ops2)}
    per_unit_ops = {k: v for k, v in sorted(per_unit_ops.items(), key=lambda kv: (-kv[1], kv[0])) if v}
    syncs = {p: n for (p, name), n in sorted(c2.counts.items()) if name == "sync"}
    fixed = {p: intercept[p] for p in STEP_PHASES if p in intercept}
    return {
        "per_chunk_layer_loop": {"total": sum(per_unit.values()),
                                 "forward": per_unit.get("forward", 0.0) + per_unit.get("student", 0.0),
                                 "recompute": per_unit.get("recompute", 0.0),
                                 "backward": per_unit.get("backward", 0.0),
                                 "by_phase": per_unit},
        "fixed_per_step": {"total": sum(fixed.values()), "by_phase": fixed},
        "student_intercept": {p: v for p, v in intercept.items() if p not in STEP_PHASES},
        "per_chunk_layer_loop_by_op": per_unit_ops,
        "item_calls_per_step": {"chunks": k2, **syncs},
        "steps_total_ops": {k1: sum(p1.values()), k2: sum(p2.values())},
    }


def _extrapolate(a, b, n1: int, n2: int, n: int, scale1: float, scale2: float, scale: float):
    """Counts at N = n1 and n2 (each times its `scale`) are linear in N: the count at n (over its scale)."""
    if isinstance(a, dict):
        return {k: _extrapolate(a.get(k, 0.0), b.get(k, 0.0), n1, n2, n, scale1, scale2, scale) for k in set(a) | set(b)}
    x1, x2 = a * scale1, b * scale2
    return (x1 + (x2 - x1) * (n - n1) / (n2 - n1)) / scale


def train_section(layers: int, compiled: bool | str, count_layers: tuple[int, int] | None = None,
                  fused_norms: bool = False) -> dict:
    """Counts at depth `layers`; with `count_layers` (n1, n2) counted at those two depths and extrapolated
    (every count is linear in N: the layers are alike), which is exact and much quicker."""
    if count_layers:
        n1, n2 = count_layers
        s1, s2 = (train_section(n, compiled, fused_norms=fused_norms) for n in (n1, n2))
        loops = SHAPE["total_ut_steps"]
        out = {"per_chunk_layer_loop": _extrapolate(s1["per_chunk_layer_loop"], s2["per_chunk_layer_loop"], n1, n2,
                                                    layers, n1 * loops, n2 * loops, layers * loops),
               "fixed_per_step": _extrapolate(s1["fixed_per_step"], s2["fixed_per_step"], n1, n2, layers, 1, 1, 1),
               "extrapolated_from_layers": [n1, n2]}
        if compiled:
            out["dynamo"] = s1["dynamo"]  # the first count compiles; the second reuses its graphs
        return out
    got = count_steps(layers, compiled, fused_norms)
    out = summarise(got["rows"], layers, SHAPE["total_ut_steps"])
    if compiled:
        # warm-up: two steps of 3 and 4 chunks (chunk indices 0..3) compile every graph; the counted steps
        # then run the same chunk indices again, so any new graph there is a recompile
        out["dynamo"] = {"warm-up": got["dynamo_warmup"], "counted_steps": got["dynamo_after_counted_steps"]}
    return out


SECTIONS = {"train": lambda a: train_section(a.layers, compiled=False, count_layers=a.count_layers),
            "train_norms_fused": lambda a: train_section(a.layers, compiled=False, count_layers=a.count_layers,
                                                         fused_norms=True),
            "train_compiled": lambda a: train_section(a.layers, compiled=True, count_layers=a.count_layers),
            "train_captured": lambda a: train_section(a.layers, compiled="captured", count_layers=a.count_layers),
            "decode": lambda a: decode_section()}


def decode_section() -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import dispatch_decode

    return {"shapes": dispatch_decode.SHAPES, "models": dispatch_decode.decode_section()}


def main(argv=None) -> dict:
    parser = Parser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=output_file, help="write the counts here")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)}")
    parser.add_argument("--layers", type=whole(1), default=24, help="N (default 24, the paper's); T = 4")
    # two different depths: a line through one point, or the same point twice, extrapolates nothing
    parser.add_argument("--count-layers", type=wholes(1, count=2, distinct=True), default=None,
                        metavar="N1,N2", help="count at these two depths and extrapolate to --layers (exact, quicker)")
    args = parser.parse_args(argv)
    wanted = [s for s in args.sections.split(",") if s]
    bad = [s for s in wanted if s not in SECTIONS]
    if bad:
        parser.error(f"unknown section(s) {', '.join(bad)}; choose from {', '.join(SECTIONS)}")
    torch.manual_seed(0)
    doc = {"script": "benchmarks/dispatch.py", "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "torch": torch.__version__, "machine": platform.processor() or platform.machine(),
           "load_avg": os.getloadavg(), "layers": args.layers, "loops": SHAPE["total_ut_steps"], "chunk": CHUNK,
           "chunks": CHUNKS, "sections": {}}
    for name in wanted:
        doc["sections"][name] = SECTIONS[name](args)
        print(f"{name}: {json.dumps(headline(doc['sections'][name]))}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    return doc


def headline(section: dict) -> dict:
    if "models" in section:  # decode
        return {kind: {path: round(out[path]["per_layer_loop"]["ops"] if path != "compiled" else out[path]["per_layer_loop"], 2)
                       for path in ("eager", "captured_eager", "compiled")} | {"stability": out["stability"]}
                for kind, out in section["models"].items()}
    unit = section["per_chunk_layer_loop"]
    out = {k: round(unit[k], 2) for k in ("total", "forward", "recompute", "backward")}
    out["fixed"] = round(section["fixed_per_step"]["total"], 1)
    out["fixed_by_phase"] = {k: round(v, 1) for k, v in section["fixed_per_step"]["by_phase"].items()}
    if "dynamo" in section:
        out["dynamo"] = section["dynamo"]
    return out


if __name__ == "__main__":
    main()
