"""The training objective (docs/method.md#losses), as functions of logits and attention outputs.

All token-level terms are *sums* over the selected tokens; the caller divides by the
number of loss tokens in the whole optimiser step (across micro-batches and processes),
so every token weighs the same however the batch was split. Position n's logits predict
token n + 1, so a mask over targets is shifted by one against the logits.

- `sft_loss`: cross-entropy of the final loop on response tokens (or a weighted sum over loops,
  `loop_weights`: how a LoopLM teacher is trained so that every loop's exit predicts).
- `kd_loss`: all-loop KD, generalised JSD with beta averaged over loops (beta 0 = forward
  KL(teacher || student), beta 1 = reverse KL(student || teacher), as in TRL's GKD).
- `align_loss`: mean over layers and loops of ||o_student - sg(o_teacher)||^2 per token.

The objective never builds [B, L, V] logits: `objective` takes hidden states and the LM
heads, gathers the loss rows, and computes lm_head and the divergence a block of rows at a
time under activation checkpointing (the idea of Liger-Kernel's fused linear JSD), so at
most one block's logits exist at once, forward or backward. `sft_loss`/`kd_loss` on full
logits are the definitions those blocks sum to.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

Tensor = torch.Tensor


def shift_mask(loss_mask: Tensor) -> Tensor:
    """Target mask [B, L] (True where token n is a response token) -> mask over logits [B, L-1]."""
    return loss_mask[:, 1:].bool()


def sft_loss(logits: Tensor, input_ids: Tensor, loss_mask: Tensor) -> Tensor:
    """Summed next-token cross-entropy over response tokens. logits [B, L, V]."""
    mask = shift_mask(loss_mask)
    pred = logits[:, :-1][mask].float()
    return F.cross_entropy(pred, input_ids[:, 1:][mask], reduction="sum")


def generalized_jsd(student_logits: Tensor, teacher_logits: Tensor, beta: float = 0.0, temperature: float = 1.0) -> Tensor:
    """Per-row divergence [n] between teacher and student next-token distributions (rows [n, V]).

    beta = 0: KL(teacher || student); beta = 1: KL(student || teacher); otherwise
    beta * KL(teacher || M) + (1 - beta) * KL(student || M) with M = beta * teacher + (1 - beta) * student.
    """
    s = F.log_softmax(student_logits.float() / temperature, dim=-1)
    t = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    if beta == 0.0:
        return (t.exp() * (t - s)).sum(-1)
    if beta == 1.0:
        return (s.exp() * (s - t)).sum(-1)
    m = torch.logsumexp(torch.stack([t + math.log(beta), s + math.log(1 - beta)]), dim=0)
    kl_t = (t.exp() * (t - m)).sum(-1)
    kl_s = (s.exp() * (s - m)).sum(-1)
    return beta * kl_t + (1 - beta) * kl_s


def kd_loss(
    student_loop_logits: list[Tensor], teacher_loop_logits: list[Tensor], loss_mask: Tensor,
    beta: float = 0.0, temperature: float = 1.0,
) -> Tensor:
    """All-loop KD: the divergence at every loop t, averaged over loops, summed over response tokens."""
    if len(student_loop_logits) != len(teacher_loop_logits):
        raise ValueError(f"student has {len(student_loop_logits)} loops, teacher {len(teacher_loop_logits)}")
    mask = shift_mask(loss_mask)
    total = student_loop_logits[0].new_zeros((), dtype=torch.float32)
    for s, t in zip(student_loop_logits, teacher_loop_logits):
        total = total + generalized_jsd(s[:, :-1][mask], t[:, :-1][mask].detach(), beta, temperature).sum()
    return total / len(student_loop_logits)


def align_loss(student_attn: list[list[Tensor]], teacher_attn: list[list[Tensor]], token_mask: Tensor) -> Tensor:
    """Attention alignment, summed over tokens: sum_n mean_{l,t} ||o_S(l,t)_n - sg(o_T(l,t)_n)||^2.

    student_attn/teacher_attn: [layer][loop] -> [B, L, d]. token_mask [B, L]: the tokens that
    count (every real token: the alignment is about representations, not predictions).
    """
    mask = token_mask.bool()
    n_terms = sum(len(per_loop) for per_loop in student_attn)
    total = student_attn[0][0].new_zeros((), dtype=torch.float32)
    grad = torch.is_grad_enabled() and any(o.requires_grad for per_loop in student_attn for o in per_loop)
    for s_layer, t_layer in zip(student_attn, teacher_attn, strict=True):
        for o_s, o_t in zip(s_layer, t_layer, strict=True):
            # checkpointed: backward recomputes the fp32 difference instead of keeping N x T of them
            # (each [tokens, d] in fp32, twice the bf16 attention outputs it is made from)
            total = total + (checkpoint(_squared_distance, o_s, o_t.detach(), mask, use_reentrant=False) if grad
                             else _squared_distance(o_s, o_t, mask))
    return total / n_terms


def _squared_distance(o_s: Tensor, o_t: Tensor, mask: Tensor) -> Tensor:
    return (o_s[mask].float() - o_t[mask].float()).pow(2).sum()


LOGIT_BLOCK_ELEMENTS = 2**25  # rows per block x vocabulary: 128 MiB of fp32 logits per block


def _blockwise_sum(fn, *rows: Tensor) -> Tensor:
    """sum_blocks fn(rows[block]); each block's intermediates are freed and recomputed in backward."""
    n = rows[0].shape[0]
    total = rows[0].new_zeros((), dtype=torch.float32)
    if n == 0:
        return total
    step = max(1, LOGIT_BLOCK_ELEMENTS // max(1, fn.vocab_size))
    grad = torch.is_grad_enabled() and any(r.requires_grad for r in rows)
    for s in range(0, n, step):
        piece = [r[s : s + step] for r in rows]
        total = total + (checkpoint(fn, *piece, use_reentrant=False) if grad else fn(*piece))
    return total


class _HeadCE:
    """Summed cross-entropy of head(h) against targets, for one block of rows."""

    def __init__(self, head) -> None:
        self.head, self.vocab_size = head, head.out_features

    def __call__(self, h: Tensor, targets: Tensor) -> Tensor:
        return F.cross_entropy(self.head(h).float(), targets, reduction="sum")


class _HeadDivergence:
    """Summed divergence between head_t(h_t) (frozen) and head_s(h_s), for one block of rows."""

    def __init__(self, student_head, teacher_head, beta: float, temperature: float) -> None:
        self.s_head, self.t_head, self.beta, self.temperature = student_head, teacher_head, beta, temperature
        self.vocab_size = student_head.out_features

    def __call__(self, h_s: Tensor, h_t: Tensor) -> Tensor:
        with torch.no_grad():
            t_logits = self.t_head(h_t)
        return generalized_jsd(self.s_head(h_s), t_logits, self.beta, self.temperature).sum()


def sft_loss_from_hidden(head, hidden: Tensor, input_ids: Tensor, loss_mask: Tensor) -> Tensor:
    """`sft_loss(head(hidden), ...)` without the [B, L, V] logits. hidden [B, L, d]."""
    mask = shift_mask(loss_mask)
    return _blockwise_sum(_HeadCE(head), hidden[:, :-1][mask], input_ids[:, 1:][mask])


def kd_loss_from_hidden(
    student_head, student_hidden: list[Tensor], teacher_head, teacher_hidden: list[Tensor], loss_mask: Tensor,
    beta: float = 0.0, temperature: float = 1.0,
) -> Tensor:
    """`kd_loss` over per-loop hidden states (T x [B, L, d]) and the two LM heads, block by block."""
    if len(student_hidden) != len(teacher_hidden):
        raise ValueError(f"student has {len(student_hidden)} loops, teacher {len(teacher_hidden)}")
    mask = shift_mask(loss_mask)
    fn = _HeadDivergence(student_head, teacher_head, beta, temperature)
    total = student_hidden[0].new_zeros((), dtype=torch.float32)
    for s, t in zip(student_hidden, teacher_hidden):
        total = total + _blockwise_sum(fn, s[:, :-1][mask], t[:, :-1][mask].detach())
    return total / len(student_hidden)


@dataclass
class LossTerms:
    """One micro-batch's objective: `total` is what is back-propagated (already normalised)."""

    total: Tensor
    parts: dict[str, float] = field(default_factory=dict)  # normalised values of each term, for logging


def objective(
    student_out, teacher_out, input_ids: Tensor, loss_mask: Tensor, attention_mask: Tensor, *,
    student_head, teacher_head=None,
    kd: bool, kd_beta: float = 0.0, kd_temperature: float = 1.0, ce_weight: float = 0.0, align_beta: float = 0.0,
    loop_weights: list[float] | None = None, n_loss_tokens: float, n_tokens: float,
) -> LossTerms:
    """The recipe's objective for one micro-batch, from hidden states and the LM heads.

    KD on:  KD_allLoops (+ ce_weight * CE) (+ align_beta * align);  KD off: CE (+ align_beta * align).
    Token sums are divided by the step's loss-token count (`n_loss_tokens`; `n_tokens` for align).
    CE is the final loop's, or sum_t loop_weights[t] * CE_t over every loop's exit (needs the per-loop states).
    """
    parts, total = {}, None

    def add(name: str, value: Tensor, weight: float, denom: float) -> None:
        nonlocal total
        value = value / max(denom, 1.0)
        parts[name] = float(value.detach())
        total = weight * value if total is None else total + weight * value

    def sft() -> Tensor:
        if not loop_weights:
            return sft_loss_from_hidden(student_head, student_out.last_hidden_state, input_ids, loss_mask)
        if student_out.hidden_states is None or len(student_out.hidden_states) != len(loop_weights):
            raise ValueError(f"loop_weights has {len(loop_weights)} entries: needs that many per-loop hidden states")
        return sum(w * sft_loss_from_hidden(student_head, h, input_ids, loss_mask)
                   for w, h in zip(loop_weights, student_out.hidden_states) if w)

    if kd:
        kd_sum = kd_loss_from_hidden(student_head, student_out.hidden_states, teacher_head, teacher_out.hidden_states,
                                     loss_mask, kd_beta, kd_temperature)
        add("kd", kd_sum, 1.0, n_loss_tokens)
        if ce_weight > 0:
            add("sft", sft(), ce_weight, n_loss_tokens)
        else:  # logged only: the final-loop cross-entropy is the number people compare runs by
            with torch.no_grad():
                parts["sft"] = float(sft()) / max(n_loss_tokens, 1.0)
    else:
        add("sft", sft(), 1.0, n_loss_tokens)
    if align_beta > 0:
        add("align", align_loss(student_out.attn_outputs, teacher_out.attn_outputs, attention_mask), align_beta, n_tokens)
    return LossTerms(total=total, parts=parts)


# --- target exit_gate: Ouro's stage-II adaptive-exit objective (docs/method.md#early-exit) ------------------------

def exit_gate_labels(loop_losses: Tensor, k: float = 50.0, gamma: float = 0.005) -> Tensor:
    """Continue labels [T-1, n] from per-token losses of every loop's exit [T, n] (detached):
    w_t = sigmoid(k * (I_{t+1} - gamma)), I_{t+1} = max(0, L_t - L_{t+1}), for t = 1..T-1.

    Indexing: lambda_t is read after loop t to decide whether loop t+1 runs, so its label is what loop t+1
    would gain. Ouro's Eq. 5-6 pair lambda^(t) with I^(t) = L^(t-1) - L^(t) for t = 2..T, the gain loop t already
    made; that leaves lambda_1, the first exit the engine can take, untrained and trains lambda_T, which
    nothing reads (the last loop always exits). Why we shift it: docs/method.md#early-exit."""
    improvement = (loop_losses[:-1] - loop_losses[1:]).clamp_min(0)
    return torch.sigmoid(k * (improvement - gamma))


def exit_gate_loss(gate_logits: Tensor, labels: Tensor) -> Tensor:
    """-[w_t log(1 - lambda_t) + (1 - w_t) log lambda_t], lambda_t = sigmoid(logit): the mean over loops, summed
    over tokens. gate_logits, labels: [T-1, n]."""
    per = -(labels * F.logsigmoid(-gate_logits) + (1 - labels) * F.logsigmoid(gate_logits))
    return per.mean(0).sum()


def per_token_cross_entropy(head, hidden: Tensor, targets: Tensor) -> Tensor:
    """Cross-entropy of head(hidden) per row [n] (no gradient), a block of rows at a time. hidden [n, d].

    The logits are fp32 even under bf16 autocast: the labels compare loop gains with gamma = 0.005 nats, finer
    than bf16 logits resolve (8 bits of mantissa: about 0.4% of a logit)."""
    step = max(1, LOGIT_BLOCK_ELEMENTS // head.out_features)
    with torch.no_grad(), torch.autocast(hidden.device.type, enabled=False):
        weight = head.weight.float()
        bias = None if head.bias is None else head.bias.float()
        pieces = [F.cross_entropy(F.linear(hidden[s : s + step].float(), weight, bias), targets[s : s + step],
                                  reduction="none") for s in range(0, hidden.shape[0], step)]
    return torch.cat(pieces) if pieces else hidden.new_zeros(0, dtype=torch.float32)


def exit_gate_objective(student_out, input_ids: Tensor, loss_mask: Tensor, *, head, gate_logit, k: float,
                        gamma: float, n_loss_tokens: float) -> LossTerms:
    """Ouro's stage II for one micro-batch, over the reply tokens: labels from each loop's detached next-token
    loss (no gradient reaches the model), the gate's logits gate_logit(h_t) [n] on loops 1..T-1 (the last loop
    always exits). Logs the loss, the mean continue label and the mean exit probability lambda."""
    mask = shift_mask(loss_mask)
    targets = input_ids[:, 1:][mask]
    states = [h[:, :-1][mask].detach() for h in student_out.hidden_states]  # T x [n, d]
    losses = torch.stack([per_token_cross_entropy(head, h, targets) for h in states])  # [T, n]
    labels = exit_gate_labels(losses, k, gamma)
    logits = torch.stack([gate_logit(h) for h in states[:-1]])  # [T-1, n]
    denom = max(n_loss_tokens, 1.0)
    total = exit_gate_loss(logits, labels) / denom
    with torch.no_grad():
        parts = {"exit_gate": float(total), "exit_continue": float(labels.mean(0).sum()) / denom,
                 "exit_lambda": float(torch.sigmoid(logits).mean(0).sum()) / denom}
    return LossTerms(total=total, parts=parts)
