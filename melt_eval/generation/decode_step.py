"""The native engine's decode token step: eager, compiled, or captured as a CUDA graph.

One step runs every row's next token through all T loops (`LoopLMModel.run_chunk` at c = 1) and returns
the last loop's logits. Eager, the cache is addressed by Python ints (`store.length`) and the attention reads
the growing slice of earlier columns. A captured step cannot do that: a CUDA graph replays fixed kernels on
fixed addresses, and torch.compile would recompile for every new int. So the compiled and graphed steps run
`run_chunk` through `kv_cache.DeviceAddressedKV`:

- the cache is the wave's `StaticStore`, whose buffers [B, KVH, S, hd] have a fixed capacity S;
- the token's entries are written at a device-side column ([1] long, `index_copy_`);
- attention reads the whole capacity under an additive mask built once per step from that column and the
  rows' key mask (`LoopLMModel._mask`): keys past the column and left padding get -inf, so the result is
  the eager step's up to the order of floating-point sums.

Modes: "eager" (today's path), "compiled" (`torch.compile(fullgraph=True)`: one graph for the whole step, no
recompile across positions; what the CPU tests and `benchmarks/dispatch_decode.py` check) and "graphed" (CUDA:
the same compiled step in `mode="reduce-overhead"`, whose CUDA graphs replay the step with one launch; the KV
buffers are marked static so the graph writes them in place). `--no-cuda-graphs` keeps a CUDA run eager.
Quantized and "w/ prefill" caches, and early exit (rows leave the batch mid-step), stay eager: `captured_mode`.

A model none of whose parameters requires a gradient (the native backend freezes the model it evaluates) is
compiled with its weights frozen in as constants (inductor's `freezing`): inductor then merges the products
that share an input, q|k|v and the MLP's gate|up (on the CPU with `cpp.enable_concat_linear`), one launch where
there were two or three. The weights are then part of the compiled code, so a change to them (seen by their
version counters) drops the compiled steps; a model that trains (the held-out check's) keeps them as inputs.
"""

from __future__ import annotations

import contextlib

import torch

from melt_eval.modeling.kv_cache import DeviceAddressedKV, PerLoopKV, SharedKV, StaticStore

Tensor = torch.Tensor
MODES = ("eager", "compiled", "graphed")


def captured_mode(device, policy, *, cuda_graphs: bool = True, exit_rule=None,
                  requested: str | None = None) -> tuple[str, str | None]:
    """(mode, note) for a wave's decode steps: `requested` where given ("eager" | "compiled" | "graphed"), else
    "graphed" on CUDA unless `cuda_graphs` is off, "eager" elsewhere. A cache or option the captured step does
    not take runs eagerly, with a note saying why (None where nothing was given up)."""
    if requested is not None and requested not in MODES:
        raise ValueError(f"decode mode must be one of {', '.join(MODES)}, got {requested!r}")
    mode = requested or ("graphed" if torch.device(device).type == "cuda" and cuda_graphs else "eager")
    if mode == "eager":
        return mode, None
    if mode == "graphed" and torch.device(device).type != "cuda":
        raise ValueError("decode mode 'graphed' captures CUDA graphs: it needs a CUDA device ('compiled' elsewhere)")
    if exit_rule is not None:
        return "eager", "early exit changes the batch inside a step: decoding without CUDA graphs"
    if type(policy) not in (PerLoopKV, SharedKV) or not isinstance(policy.store, StaticStore):
        return "eager", "a quantized or per-loop-prompt cache is read eagerly: decoding without CUDA graphs"
    return mode, None


def _logits(model, policy, key_mask: Tensor, kv_sharing, tokens: Tensor, position_ids: Tensor) -> Tensor:
    """One decode step: [B, 1] tokens at [B, 1] positions -> the last loop's logits [B, V] in fp32."""
    x, _ = model.model.run_chunk(tokens, position_ids, policy, key_mask=key_mask, kv_sharing=kv_sharing)
    return model.lm_head(x[:, -1]).float()


class DecodeStep:
    """`step(tokens [B, 1], position_ids [B, 1]) -> logits [B, V]` through `policy`, advancing its cache by one.

    `key_mask` [B, S] is True where a cache column holds a real token (left padding False). The compiled modes
    take a per-loop or shared policy over a StaticStore (`captured_mode` says which can) whose `length` columns
    are filled. `backend` is torch.compile's (inductor by default; "aot_eager" traces without generating code)."""

    def __init__(self, model, policy, key_mask: Tensor, *, kv_sharing=None, mode: str = "eager", backend=None) -> None:
        if mode not in MODES:
            raise ValueError(f"decode mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.model, self.policy, self.key_mask, self.kv_sharing, self.mode = model, policy, key_mask, kv_sharing, mode
        self.fn = None
        if mode == "eager":
            return
        self.store = policy.store
        self.column = torch.zeros(1, dtype=torch.long, device=key_mask.device)
        self.device_policy = DeviceAddressedKV(policy, self.column)
        # Shapes change only between waves and calls (rows, capacity): torch.compile's automatic dynamic shapes
        # recompile once for a second shape, never across positions.
        options = {"fullgraph": True}
        if backend is not None:
            options["backend"] = backend
        if mode == "graphed":
            options["mode"] = "reduce-overhead"
            for buffer in self.store.buffers.values():  # written in place by the graph: the same address at every replay
                torch._dynamo.mark_static_address(buffer)
            torch._dynamo.mark_static_address(self.column)
        self.fn = torch.compile(_logits, **options)
        self.inductor_config = frozen_weights_config(model) if backend in (None, "inductor") else {}

    def __call__(self, tokens: Tensor, position_ids: Tensor) -> Tensor:
        if self.fn is None:
            return _logits(self.model, self.policy, self.key_mask, self.kv_sharing, tokens, position_ids)
        if self.store.length >= self.store.capacity:
            raise RuntimeError(f"KV cache full: {self.store.length + 1} > capacity {self.store.capacity}")
        self.column.fill_(self.store.length)
        if self.mode == "graphed":
            torch.compiler.cudagraph_mark_step_begin()  # the previous step's logits have been consumed
        # read where inductor compiles: in this call; no patch to open (host time every token) when there is none
        patch = torch._inductor.config.patch(self.inductor_config) if self.inductor_config else contextlib.nullcontext()
        with patch:
            logits = self.fn(self.model, self.device_policy, self.key_mask, self.kv_sharing, tokens, position_ids)
        self.store.length += 1
        # a graph's output lives in memory its next replay overwrites
        return logits.clone() if self.mode == "graphed" else logits


def frozen_weights_config(model) -> dict:
    """Inductor's settings for compiling `model`'s step: its weights frozen in where nothing of it trains (see the
    module's docstring), else none. Frozen weights that changed since the last compile drop every compiled step
    (`torch._dynamo.reset`): they live in the compiled code, which dynamo's guards do not check."""
    params = list(model.parameters())
    if any(p.requires_grad for p in params):
        return {}
    signature = tuple((p.data_ptr(), p._version) for p in params)
    if getattr(model, "_frozen_decode_weights", signature) != signature:
        torch._dynamo.reset()
    model._frozen_decode_weights = signature
    return {"freezing": True, "cpp.enable_concat_linear": True}
