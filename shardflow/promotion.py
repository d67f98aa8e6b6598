"""The promotion gate's rule: a new model version replaces the current one unless it scores worse on the same
held-out events, by the figure the config names (`promote_on`), beyond `promotion_margin`.

AUC is the default: both workloads have it, every run measures it, and on a few thousand held-out
events it moves least between two near-equal models. A sequence model may be gated on its
full-catalog NDCG@10 instead (shardflow.model.ranking), the figure current papers report.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardflow.model.metrics import Metrics

PROMOTE_ON = ("auc", "full_ndcg_at_10")
LABELS = {"auc": "AUC", "full_ndcg_at_10": "full-catalog NDCG@10"}


@dataclass(frozen=True)
class Verdict:
    """The gate's decision on `figure`: the new version's value, the current one's (None: a cold start)."""

    promoted: bool
    figure: str
    new: float
    previous: float | None

    @property
    def label(self) -> str:
        return LABELS[self.figure]


def judge(new: Metrics, previous: Metrics | None, on: str, margin: float) -> Verdict:
    """Promote `new` unless its `on` figure is below `previous`'s by more than `margin` (no previous: promote)."""
    mine = getattr(new, on)
    theirs = None if previous is None else getattr(previous, on)
    if mine is None:
        raise ValueError(f"the new version has no {LABELS[on]}; accepted: promote_on a figure it measured")
    return Verdict(theirs is None or mine >= theirs - margin, on, mine, theirs)


def rejection(verdict: Verdict, number: int, source: int, margin: float) -> str:
    """Why version `number` stays unpromoted, `source` current."""
    return (f"version {number} not promoted: {verdict.label} {verdict.new:.4f} is below version {source}'s "
            f"{verdict.previous:.4f} by more than promotion_margin {margin}; version {source} stays current")
