"""Evaluation metrics of either workload, from logits and labels on the host.

Sequences (leave-last-out): each held-out item's logit against sampled negatives, a
count per example that adds up over chunks and devices. Click logs: AUC over the whole
held-out split (a ranking of every example, so the logits are gathered first) and the
mean log-loss.

Each workload's scored examples are a value that adds up over chunks and devices (`a + b`;
`sum(parts, RankCounts())` from nothing), and whose `.metrics()` are the model's `Metrics`.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

METRICS = ("auc", "hr_at_10", "ndcg_at_10", "logloss")  # every summary has each key: None where the workload has none
# The held-out item ranked among the whole catalog (sequences: shardflow.model.ranking); a version's summary
# has each key; an epoch's held-out record none (its figures are the sampled protocol's), its validation split's
# the numbers (val_full_…) where ranked.
FULL_METRICS = ("full_ranking", "full_hr_at_10", "full_ndcg_at_10", "full_hr_at_20", "full_ndcg_at_20")
# What is ranked among the whole catalog (shardflow.model.ranking; config train.full_ranking): here, beside the
# figures, so that the config's checks import no PyTorch.
SEEN = ("exclude-seen", "include-seen")
FULL_RANKING = (*SEEN, "off")
FULL_FIGURES = FULL_METRICS[1:]  # its numbers (a validation split's, per epoch: shardflow.training.validation)


@dataclass(frozen=True)
class Metrics:
    """A model's metrics on held-out examples: AUC, and HR@10 and NDCG@10 among sampled candidates (sequences)
    or log-loss (click logs), over `users` examples (None where a record did not keep the count); with the
    full-catalog ranking, HR and NDCG at 10 and 20 among every item."""

    auc: float | None
    users: int | None = None
    hr_at_10: float | None = None
    ndcg_at_10: float | None = None
    logloss: float | None = None
    full_ranking: str | None = None  # what the full-catalog figures rank: exclude-seen or include-seen
    full_hr_at_10: float | None = None
    full_ndcg_at_10: float | None = None
    full_hr_at_20: float | None = None
    full_ndcg_at_20: float | None = None

    def values(self, prefix: str = "", full: bool = False) -> dict[str, float | None]:
        """Under every key of METRICS (and FULL_METRICS with `full`), None where the workload has none; each key
        prefixed (val_, previous_)."""
        return {prefix + k: getattr(self, k) for k in (*METRICS, *(FULL_METRICS if full else ()))}

    @classmethod
    def read(cls, values: Mapping[str, Any], prefix: str = "") -> Metrics:
        """The metrics a summary, checkpoint manifest or epoch's record keeps under `prefix` keys."""
        return cls(**{k: values.get(prefix + k) for k in (*METRICS, *FULL_METRICS)})

    def text(self) -> str:
        """One line: 'AUC 0.7906, HR@10 0.4510, NDCG@10 0.2760' (with '; full catalog, seen items excluded: HR@10
        0.0576, NDCG@10 0.0298' where ranked among every item) or 'AUC 0.7100, log-loss 0.4900'."""
        if self.logloss is not None:
            second = f"log-loss {self.logloss:.4f}"
        else:  # a version made before NDCG@10 was measured has none
            ndcg = "" if self.ndcg_at_10 is None else f", NDCG@10 {self.ndcg_at_10:.4f}"
            second = f"HR@10 {self.hr_at_10:.4f}{ndcg}"
            if self.full_hr_at_10 is not None:  # how it was ranked, where a record keeps it (a validation's: no)
                seen = {"exclude-seen": ", seen items excluded", "include-seen": ", seen items included"}
                second += (f"; full catalog{seen.get(self.full_ranking or '', '')}: HR@10 {self.full_hr_at_10:.4f}, "
                           f"NDCG@10 {self.full_ndcg_at_10:.4f}")
        return f"AUC {self.auc:.4f}, {second}"


@dataclass(frozen=True)
class RankCounts:
    """Scored sequence examples, counted (`of` logits [E, C] whose column 0 is the positive)."""

    auc: float = 0.0  # examples whose positive scores above the first negative (ties half)
    hits: float = 0.0  # positives ranked in the top 10
    ndcg: float = 0.0  # NDCG@10, summed
    examples: int = 0

    @classmethod
    def of(cls, logit: np.ndarray, examples: object = None) -> RankCounts:
        return cls(*hits(logit), examples=len(logit))

    def __add__(self, other: RankCounts) -> RankCounts:
        return RankCounts(self.auc + other.auc, self.hits + other.hits, self.ndcg + other.ndcg,
                          self.examples + other.examples)

    def metrics(self) -> Metrics:
        """AUC against the first sampled negative, HR@10 and NDCG@10 among the candidates, over `users`
        held-out items."""
        n = max(self.examples, 1)
        return Metrics(self.auc / n, self.examples, hr_at_10=self.hits / n, ndcg_at_10=self.ndcg / n)


def _no_scores() -> np.ndarray:
    return np.zeros(0, dtype=np.float32)


@dataclass(frozen=True)
class ScoredRows:
    """Scored click rows: their logits and labels (AUC ranks the whole split, so they are kept, not counted)."""

    logit: np.ndarray = field(default_factory=_no_scores)
    label: np.ndarray = field(default_factory=_no_scores)

    @classmethod
    def of(cls, logit: np.ndarray, examples: Any) -> ScoredRows:
        return cls(np.asarray(logit, dtype=np.float32).reshape(-1), examples.labels)

    def __add__(self, other: ScoredRows) -> ScoredRows:
        return ScoredRows(np.concatenate([self.logit, other.logit]), np.concatenate([self.label, other.label]))

    def metrics(self) -> Metrics:
        """AUC and mean log-loss over `users` held-out rows (each row is its own user in the store)."""
        return Metrics(roc_auc(self.logit, self.label), int(self.label.size), logloss=log_loss(self.logit, self.label))


Scored = RankCounts | ScoredRows  # either workload's


def hits(logit: np.ndarray) -> tuple[float, float, float]:
    """(AUC count, HR@10 count, NDCG@10 sum) of logits [E, C] whose column 0 is the positive.

    The positive's rank r (0: first) is the number of candidates scored above it; HR@10
    counts r < 10 and NDCG@10 adds 1 / log2(r + 2) there (one relevant item: its ideal
    DCG is 1), as in the SASRec paper's evaluation (Kang & McAuley, ICDM 2018). Ties count
    against the positive as a random order would place it: with `g` candidates above it and
    `t` equal to it, each rank g .. g + t is equally likely (rank_gains), so constant logits
    give HR@10 = 10 / C, never a hit for free.
    """
    pos, neg = logit[:, :1], logit[:, 1:]
    auc = float((pos[:, 0] > neg[:, 0]).sum() + 0.5 * (pos[:, 0] == neg[:, 0]).sum())
    hit, gain = rank_gains((neg > pos).sum(axis=1), (neg == pos).sum(axis=1))
    return auc, float(hit.sum()), float(gain.sum())


@functools.cache
def discounts(k: int) -> np.ndarray:
    """[k + 1]: entry j is the summed NDCG gains of ranks 0 .. j-1 (1 / log2(r + 2)); ranks from k gain nothing."""
    return np.concatenate([[0.0], np.cumsum(1.0 / np.log2(np.arange(k) + 2.0))])


def rank_gains(above: np.ndarray, tied: np.ndarray, k: int = 10) -> tuple[np.ndarray, np.ndarray]:
    """Per example, the expected HR@k and NDCG@k of a positive with `above` candidates scored higher and `tied`
    scored the same, every order of the tied ones equally likely (rank uniform on above .. above + tied)."""
    discount = discounts(k)
    above = np.asarray(above, dtype=np.int64)
    places = np.asarray(tied, dtype=np.int64) + 1
    first, last = np.minimum(above, k), np.minimum(above + places, k)
    return (last - first) / places, (discount[last] - discount[first]) / places


def roc_auc(logit: np.ndarray, label: np.ndarray) -> float:
    """The probability that a clicked example scores above an unclicked one (ties count half):
    the Mann-Whitney statistic from average ranks; NaN without both classes."""
    positives = int(label.sum())
    negatives = label.size - positives
    if positives == 0 or negatives == 0:
        return float("nan")
    ranks = average_ranks(logit)
    return float((ranks[label == 1].sum() - positives * (positives + 1) / 2) / (positives * negatives))


def average_ranks(values: np.ndarray) -> np.ndarray:
    """Ranks from 1, equal values sharing the mean of their ranks (scipy.stats.rankdata's default, without
    importing scipy.stats: half a second of every process's start-up)."""
    order = np.argsort(values, kind="stable")
    ordered = values[order]
    starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])
    ends = np.r_[starts[1:], values.size]
    ranks = np.empty(values.size, dtype=np.float64)
    ranks[order] = np.repeat((starts + ends + 1) / 2.0, ends - starts)
    return ranks


def log_loss(logit: np.ndarray, label: np.ndarray) -> float:
    """Mean binary cross-entropy of logits (computed from the logits, so no probability rounds to 0 or 1)."""
    if logit.size == 0:
        return float("nan")
    z = logit.astype(np.float64)
    return float(np.mean(np.logaddexp(0.0, z) - label * z))
