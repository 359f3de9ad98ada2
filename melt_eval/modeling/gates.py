"""The one rule by which a shared KV entry is updated across loops (docs/method.md#gates).

Per layer and token, at loop t (a_t is the layer's attention input at loop t):

    h_1 = a_1
    h_t = z_t * h_{t-1} + (1 - z_t) * a_t              t >= 2
    k_t = RoPE(k_proj(h_t)),  v_t = v_proj(h_t)

and the gate z_t selects the variant:

    elementwise  sigmoid(a_t W_z + h_{t-1} U_z + b_z), z in R^d      (MELT)
    scalar       sigmoid(a_t w_z + h_{t-1} u_z + b_z), one per token ("single-gated")
    ema          ema_decay (0.2)
    mean         (t-1)/t: h_t is the running mean of a_1..a_t
    last         0: h_t = a_t      (also Ouro's untrained kv_sharing "last")
    first        1: h_t = a_1      (also Ouro's untrained kv_sharing "first")

MELT's layers, Ouro's untrained sharing baselines and the vLLM plugin all update through `gate_update`.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor

GATES = ("elementwise", "scalar", "ema", "mean", "last", "first")
LEARNED_GATES = ("elementwise", "scalar")


def gate_update(gate, h_prev: Tensor, a: Tensor, loop: int) -> tuple[Tensor, Tensor | float]:
    """(h_t, z_t) for loop t >= 2 (the table above).

    `gate` has `.kind`, `.ema_decay` and, for the learned gates, `.logits(h_prev, a)` giving
    a_t W_z + h_{t-1} U_z + b_z.
    """
    if gate.kind in LEARNED_GATES:
        z = torch.sigmoid(gate.logits(h_prev, a))
    else:
        z = {"ema": gate.ema_decay, "mean": (loop - 1) / loop, "last": 0.0, "first": 1.0}[gate.kind]
    return mix(a, h_prev, z), z


def mix(start: Tensor, end: Tensor, weight: Tensor | float) -> Tensor:
    """weight * end + (1 - weight) * start in one kernel (`torch.lerp`; the chunked training step is bound by
    the number of kernels it launches). Exact at the fixed gates' 0 and 1 (lerp returns start at 0, end at 1).
    lerp takes one dtype; operands of several (none in the model's own code paths) promote as the sum would."""
    if start.dtype == end.dtype and (not isinstance(weight, Tensor) or weight.dtype == start.dtype):
        return torch.lerp(start, end, weight)
    if start.dtype == end.dtype and weight.dim() == 0:
        # a 0-dim weight of a wider dtype (phase 1's alpha in a compiled step): lerp would first round it to
        # start's dtype; in its own precision it gives what a Python float weight gives
        return torch.lerp(start.to(weight.dtype), end.to(weight.dtype), weight).to(start.dtype)
    return weight * end + (1 - weight) * start


class FixedGate:
    """A gate without parameters (`first`, `last`, `mean`, `ema`): Ouro's untrained sharing is one of these."""

    def __init__(self, kind: str, ema_decay: float = 0.2) -> None:
        if kind in LEARNED_GATES or kind not in GATES:
            raise ValueError(f"{kind!r} is not a fixed gate; fixed gates: {', '.join(g for g in GATES if g not in LEARNED_GATES)}")
        self.kind, self.ema_decay = kind, ema_decay
