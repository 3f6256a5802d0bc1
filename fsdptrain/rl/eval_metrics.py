"""Evaluation with n samples per prompt: unbiased pass@k, mean@n and majority vote (docs/evaluation.md).

Legend: `_PN` one row per evaluation prompt of this rank, one column per sample (n columns).

Every metric here is a MEAN whose total and count are sums over prompts (pass@k, maj@n: count = prompts; mean@n:
count = samples), so the ranks' shares add up to the value over every evaluation prompt, whatever the number of
ranks. Where we depart from verl: verl's `best@k` is a bootstrap estimate of the best reward in k draws; pass@k here
is the closed-form unbiased estimator of the chance that at least one of k samples is correct.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

from fsdptrain.metrics.typed import Mean, Metrics


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimator of pass@k from n samples of which c are correct (Chen et al., arXiv 2107.03374):

        pass@k = 1 - C(n - c, k) / C(n, k) = 1 - prod_{i = n-c+1}^{n} (1 - k / i)

    (the product form never forms the binomials, so it neither overflows nor loses precision for large n); 1 when
    n - c < k (every k-subset holds a correct sample). It is the mean, over every k-subset of the n samples, of
    "the subset holds a correct sample", so its expectation is exactly 1 - (1 - p)^k for a prompt solved with
    probability p. Resampling k of the n samples with replacement (a bootstrap best-of-k) estimates
    1 - (1 - c/n)^k instead, which is biased low: (1 - x)^k is convex, so E[(1 - c/n)^k] >= (1 - p)^k (Jensen).
    Example: n = 5, c = 2: k = 1 gives 2/5, k = 2 gives 1 - C(3, 2)/C(5, 2) = 0.7.
    """
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n, got k={k} with n={n} samples")
    if not 0 <= c <= n:
        raise ValueError(f"the number of correct samples must be in [0, n={n}], got {c}")
    if n - c < k:
        return 1.0
    product = 1.0
    for i in range(n - c + 1, n + 1):
        product *= 1.0 - k / i
    return 1.0 - product


def majority_index(answers: Sequence[str]) -> int:
    """The index of the first sample whose answer is the most frequent one (ties: the answer seen first)."""
    if not answers:
        raise ValueError("a majority vote needs at least one answer")
    counts: dict[str, int] = {}
    for answer in answers:
        counts[answer] = counts.get(answer, 0) + 1
    best = max(counts.values())
    return next(i for i, answer in enumerate(answers) if counts[answer] == best)


def sampled_eval_metrics(rewards_PN: Sequence[Sequence[float]], answers_PN: Optional[Sequence[Sequence[str]]], *,
                         n: int, ks: Sequence[int], threshold: float) -> Metrics:
    """This rank's ``eval/pass@{k}`` for each k, ``eval/mean@{n}`` and (with answers) ``eval/maj@{n}``.

    Every row holds ``n`` samples (the names carry n, so a rank's names never depend on its rows). A sample is
    correct when its reward >= ``threshold``. Per prompt p with c_p correct samples of n:
        pass@k (MEAN over prompts): pass_at_k(n, c_p, k);
        mean@n (MEAN over samples): the reward of each sample;
        maj@n (MEAN over prompts): 1 when the sample `majority_index` picks from p's answers is correct (the reward
            of the majority answer), else 0; absent without answers (rewards whose answers cannot be compared).
    """
    if any(len(row) != n for row in rewards_PN):
        raise ValueError(f"every evaluation prompt needs n={n} samples")
    correct_PN = [[reward >= threshold for reward in row] for row in rewards_PN]
    num_prompts = len(rewards_PN)
    metrics = {f"eval/pass@{k}": Mean(sum(pass_at_k(n, sum(row), k) for row in correct_PN), num_prompts)
               for k in ks}
    metrics[f"eval/mean@{n}"] = Mean(sum(sum(row) for row in rewards_PN), num_prompts * n)
    if answers_PN is not None:
        majority = sum(float(row[majority_index(answers)]) for row, answers in zip(correct_PN, answers_PN))
        metrics[f"eval/maj@{n}"] = Mean(majority, num_prompts)
    return Metrics(metrics)
