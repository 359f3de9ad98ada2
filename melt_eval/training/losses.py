"""The training objective of MELT.md "Losses", as functions of logits and attention outputs.

All token-level terms are *sums* over the selected tokens; the caller divides by the
number of loss tokens in the whole optimiser step (across micro-batches and processes),
so every token weighs the same however the batch was split. Position n's logits predict
token n + 1, so a mask over targets is shifted by one against the logits.

- `sft_loss`: cross-entropy of the final loop on response tokens.
- `kd_loss`: all-loop KD, generalised JSD with beta averaged over loops (beta 0 = forward
  KL(teacher || student), beta 1 = reverse KL(student || teacher), as in TRL's GKD).
- `align_loss`: mean over layers and loops of ||o_student - sg(o_teacher)||^2 per token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

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
    for s_layer, t_layer in zip(student_attn, teacher_attn, strict=True):
        for o_s, o_t in zip(s_layer, t_layer, strict=True):
            diff = o_s[mask].float() - o_t[mask].detach().float()
            total = total + diff.pow(2).sum()
    return total / n_terms


@dataclass
class LossTerms:
    """One micro-batch's objective: `total` is what is back-propagated (already normalised)."""

    total: Tensor
    parts: dict[str, float] = field(default_factory=dict)  # normalised values of each term, for logging


def objective(
    student_out, teacher_out, input_ids: Tensor, loss_mask: Tensor, attention_mask: Tensor, *,
    kd: bool, kd_beta: float = 0.0, kd_temperature: float = 1.0, ce_weight: float = 0.0, align_beta: float = 0.0,
    n_loss_tokens: float, n_tokens: float,
) -> LossTerms:
    """The recipe's objective for one micro-batch.

    KD on:  KD_allLoops (+ ce_weight * CE) (+ align_beta * align);  KD off: CE (+ align_beta * align).
    Token sums are divided by the step's loss-token count (`n_loss_tokens`; `n_tokens` for align).
    """
    parts, total = {}, None

    def add(name: str, value: Tensor, weight: float, denom: float) -> None:
        nonlocal total
        value = value / max(denom, 1.0)
        parts[name] = float(value.detach())
        total = weight * value if total is None else total + weight * value

    if kd:
        add("kd", kd_loss(student_out.loop_logits, teacher_out.loop_logits, loss_mask, kd_beta, kd_temperature), 1.0, n_loss_tokens)
        if ce_weight > 0:
            add("sft", sft_loss(student_out.logits, input_ids, loss_mask), ce_weight, n_loss_tokens)
        else:  # logged only: the final-loop cross-entropy is the number people compare runs by
            with torch.no_grad():
                parts["sft"] = float(sft_loss(student_out.logits, input_ids, loss_mask)) / max(n_loss_tokens, 1.0)
    else:
        add("sft", sft_loss(student_out.logits, input_ids, loss_mask), 1.0, n_loss_tokens)
    if align_beta > 0:
        add("align", align_loss(student_out.attn_outputs, teacher_out.attn_outputs, attention_mask), align_beta, n_tokens)
    return LossTerms(total=total, parts=parts)
