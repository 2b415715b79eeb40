"""The metrics of the evaluation suite, each checked on cases with a known answer (tests/research/eval).

- `kl_per_token`: KL(reference ‖ candidate) per teacher-forced position, from log-probabilities
  (the paper's fidelity measure: full prefill is the reference).
- `argmax_agreement`, `first_divergence`: does the candidate pick the reference's tokens, and
  for how long does its greedy decode stay identical (paper, Quality: "identical to full prefill
  for up to 2.4x more tokens").
- `auc`: threshold-free ROC AUC with ties counted as one half (the Mann-Whitney U statistic),
  as in the paper's position-invariance test.
- `rel_l2`: relative L2 error, for the rotation study.
- `wilson`, `bootstrap_ci`: confidence intervals for proportions and paired differences.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch


def kl_per_token(ref_logprobs: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    """KL(ref ‖ cand) per row of two log-prob tensors [n, vocab] -> [n] (nats, float64, >= 0)."""
    ref, cand = ref_logprobs.double(), logprobs.double()
    p = ref.exp()
    # 0 · log 0 = 0: positions the reference gives no mass contribute nothing.
    terms = torch.where(p > 0, p * (ref - cand), torch.zeros_like(p))
    return terms.sum(-1).clamp_min(0.0)


def argmax_agreement(ref_logprobs: torch.Tensor, logprobs: torch.Tensor) -> float:
    """Fraction of positions where both pick the same top token."""
    return float((ref_logprobs.argmax(-1) == logprobs.argmax(-1)).double().mean())


def first_divergence(greedy_ids: Sequence[int], logprobs: torch.Tensor) -> int:
    """Teacher-forcing the reference's greedy tokens `greedy_ids` under the candidate (log-probs
    [len(greedy_ids), vocab]), the first index where the candidate's argmax differs; that is where
    the candidate's own greedy decode would leave the reference's. len(greedy_ids) if never."""
    picks = logprobs.argmax(-1).tolist()
    for i, (a, b) in enumerate(zip(greedy_ids, picks)):
        if a != b:
            return i
    return len(greedy_ids)


def exact(answer_ids: Sequence[int], logprobs: torch.Tensor) -> bool:
    """Every answer token is the argmax: greedy decoding reproduces the answer."""
    return first_divergence(answer_ids, logprobs) == len(answer_ids)


def auc(positives, negatives) -> float:
    """P(score of a positive > score of a negative) + 0.5·P(tie): ROC AUC via average ranks."""
    pos, neg = np.asarray(positives, dtype=np.float64).ravel(), np.asarray(negatives, dtype=np.float64).ravel()
    if not len(pos) or not len(neg):
        raise ValueError("auc needs at least one positive and one negative score")
    scores = np.concatenate([pos, neg])
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(len(scores), dtype=np.float64)
    sorted_scores = scores[order]
    # Average rank within each run of equal scores (ties count one half).
    starts = np.flatnonzero(np.r_[True, sorted_scores[1:] != sorted_scores[:-1]])
    ends = np.r_[starts[1:], len(scores)]
    for s, e in zip(starts, ends):
        ranks[order[s:e]] = 0.5 * (s + e - 1) + 1.0
    u = ranks[: len(pos)].sum() - len(pos) * (len(pos) + 1) / 2
    return float(u / (len(pos) * len(neg)))


def roc_curve(positives, negatives, points: int = 101) -> tuple[np.ndarray, np.ndarray]:
    """(false positive rate, true positive rate) at `points` thresholds spanning the scores."""
    pos, neg = np.asarray(positives, dtype=np.float64).ravel(), np.asarray(negatives, dtype=np.float64).ravel()
    lo, hi = min(pos.min(), neg.min()), max(pos.max(), neg.max())
    thresholds = np.linspace(hi, lo, points)
    tpr = np.array([(pos >= t).mean() for t in thresholds])
    fpr = np.array([(neg >= t).mean() for t in thresholds])
    return np.r_[0.0, fpr], np.r_[0.0, tpr]


def rel_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    """‖x − ref‖ / ‖ref‖ over all elements, in float64."""
    x, ref = x.double(), ref.double()
    return float((x - ref).norm() / ref.norm().clamp_min(1e-300))


def cosine_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Cosine similarity of matching rows of a, b [n, d] -> [n]."""
    a, b = a.double(), b.double()
    return (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1)).clamp_min(1e-300)


@dataclass(frozen=True)
class Interval:
    value: float
    low: float
    high: float

    def as_dict(self) -> dict:
        return {"value": self.value, "low": self.low, "high": self.high}

    def __str__(self) -> str:
        return f"{self.value:.3f} [{self.low:.3f}, {self.high:.3f}]"


def wilson(successes: int, n: int, z: float = 1.96) -> Interval:
    """Wilson score interval of a proportion (95% by default)."""
    if n == 0:
        return Interval(float("nan"), 0.0, 1.0)
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return Interval(p, float(max(0.0, centre - half)), float(min(1.0, centre + half)))


def bootstrap_ci(
    values: Sequence,
    statistic: Callable[[np.ndarray], float] = np.mean,
    n_boot: int = 2000,
    level: float = 0.95,
    seed: int = 0,
) -> Interval:
    """Percentile bootstrap over the rows of `values` (resample cases; paired data stays paired)."""
    values = np.asarray(values, dtype=np.float64)
    point = float(statistic(values))
    if len(values) < 2:
        return Interval(point, point, point)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(values), size=(n_boot, len(values)))
    stats = np.array([statistic(values[i]) for i in idx])
    a = (1 - level) / 2
    return Interval(point, float(np.quantile(stats, a)), float(np.quantile(stats, 1 - a)))


def p95(values) -> float:
    values = np.asarray(values, dtype=np.float64)
    return float(np.percentile(values, 95)) if len(values) else float("nan")
