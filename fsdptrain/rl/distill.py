"""On-policy distillation's learning signal: the per-token reverse KL to a teacher, as an advantage (pure torch).

Legend: `_BR` a rank's sequences right-padded to the longest response (element j of a row is response token j).

The student samples (as in GRPO); for each sampled policy token ``y_t`` the teacher scores it in a packed forward.
The signal is the k1 estimate of the reverse KL at that token, ``kl_t = log p_student(y_t) - log p_teacher(y_t)``
(an unbiased single-sample estimate of KL(student || teacher) at that position), and the advantage is its negative
times ``coef`` with discount 0: each token is pushed by its own KL only, never by a later token's. It is added
*after* the task estimator's normalisation (whitening, GRPO's std), so it keeps its scale:

    A_t = [task_reward == "add"] * A_task_t - coef * kl_t        (policy tokens; 0 at a tool's token)

The loss then aggregates these advantages as any other (``loss.agg_mode`` over the global mini-batch,
docs/loss.md); nothing here divides by a count. Departures: no top-k or full-vocabulary KL (NeMo RL offers one),
and no reward-to-go over the KL (Tinker's discount 0 as well). docs/algorithms.md, "On-policy distillation".
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from fsdptrain.metrics.typed import Max, Mean, Metrics


@dataclass(frozen=True)
class DistillSettings:
    """``algorithm.distill``'s coefficient, and whether the task estimator's advantage is added."""

    coef: float
    add_task: bool


def reverse_kl(student_BR: Tensor, teacher_BR: Tensor) -> Tensor:
    """``log p_student - log p_teacher`` per sampled token (k1), float64 for the statistics."""
    return student_BR.double() - teacher_BR.double()


def distill_advantages(task_adv_BR: Tensor, student_BR: Tensor, teacher_BR: Tensor, mask_BR: Tensor, *,
                       coef: float, add_task: bool) -> Tensor:
    """``[add_task] * task_adv - coef * (student - teacher)`` where ``mask_BR`` (the policy's tokens), 0 elsewhere;
    float32 like every advantage."""
    signal_BR = -coef * reverse_kl(student_BR, teacher_BR)
    if add_task:
        signal_BR = signal_BR + task_adv_BR.double()
    return signal_BR.where(mask_BR, 0.0).float()


def distill_metrics(student_BR: Tensor, teacher_BR: Tensor, mask_BR: Tensor) -> Metrics:
    """This rank's ``distill/*`` over the policy's tokens (``mask_BR``): the reverse KL per token (MEAN: total and
    token count, so the logged mean pools every policy token of the step whatever the packing, micro-batching or
    rank split; MAX) and the teacher's log-prob of the sample per token (MEAN). An empty mask leaves them absent."""
    kl_BR = reverse_kl(student_BR, teacher_BR)
    return Metrics({
        "distill/reverse_kl_mean": Mean.of(kl_BR, mask_BR),
        "distill/reverse_kl_max": Max.of(kl_BR, mask_BR),
        "distill/teacher_logprob_mean": Mean.of(teacher_BR.double(), mask_BR),
    })
