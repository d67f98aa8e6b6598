"""Global batches in a deterministic order, their split into sub-batches, and what each looks up.

Every trainer loads the same TrainData and derives the epoch's order itself (a seeded
permutation of the training targets), so no batch ever travels over the network. An
epoch has floor(targets / batch_size) steps; the remainder of the permutation is left
for that epoch (a different remainder every epoch). A global batch is split into one
contiguous sub-batch per trainer (sizes differ by at most one).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shardflow.errors import InputError
from shardflow.examples import PAD, Examples, examples_at, target_positions
from shardflow.model import BatchIndex, ModelConfig
from storage.dataset import Dataset



@dataclass(frozen=True)
class TrainData:
    offsets: np.ndarray  # int64 [users + 1]
    item: str  # the sequence table
    columns: dict  # table -> int64 [events]: the item sequence and the feature columns
    rows: dict  # table -> rows
    targets: np.ndarray  # int64: event index of every training target
    eval_targets: np.ndarray  # int64: event index of every user's held-out last item

    @classmethod
    def load(cls, dataset: str | Dataset, features: tuple[str, ...] = (), window: tuple[int, int] = (0, 0)) -> "TrainData":
        """The dataset's training data; `window` = (first segment trained on, first segment evaluated on).

        A model version trains on the events of the newest parts (and on each user's last
        event before them, which the earlier version held out) and is evaluated on the
        held-out last items that lie in them, while users' earlier events still serve as
        history: windows select targets, never history.
        """
        ds = dataset if isinstance(dataset, Dataset) else Dataset.open(dataset)
        item = ds.info.sequence_table
        if item is None:
            raise InputError(
                f"dataset {ds.path} has no item sequence (tables {', '.join(ds.info.table_names)}); "
                "accepted: a dataset imported from sasrec, s3rec or recbole, or made by 'shardflow synth'"
            )
        unknown = [f for f in features if f not in ds.info.table_names or f == item]
        if unknown:
            accepted = list(ds.info.feature_tables)
            raise InputError(f"feature tables {unknown}; accepted: {', '.join(accepted) or 'none in this dataset'}")
        offsets = ds.offsets()
        targets, held_out = target_positions(offsets, "train"), target_positions(offsets, "eval")
        if any(window):
            segment = ds.event_segments()
            targets = targets[window_key(segment, targets) >= window[0]]
            held_out = held_out[segment[held_out] >= window[1]]
        if targets.size == 0:
            where = f" in parts {window[0] + 1}.. (the training window)" if window[0] else ""
            raise InputError(f"dataset {ds.path}: no training examples{where} (a user's examples are their "
                             "events after the first and before the last)")
        return cls(
            offsets=offsets,
            item=item,
            columns={t: ds.ids(t).astype(np.int64) for t in (item, *features)},
            rows={t: ds.info.table(t).rows for t in (item, *features)},
            targets=targets,
            eval_targets=held_out,
        )

    def steps_per_epoch(self, batch_size: int) -> int:
        return self.targets.size // batch_size

    def epoch_order(self, epoch: int, seed: int) -> np.ndarray:
        return np.random.default_rng([seed, epoch]).permutation(self.targets)

    def examples(self, targets: np.ndarray, config: ModelConfig, seed: int, negatives: int | None = None) -> Examples:
        return examples_at(
            self.offsets,
            self.columns[self.item],
            targets,
            self.rows[self.item],
            history=config.history,
            negatives=config.negatives if negatives is None else negatives,
            seed=seed,
        )


def window_key(segment: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """The part that puts each training target in a window: its own, or the next event's if that is newer.

    A user's last event before a window was held out by the version that saw it, never
    trained on: it joins the window its successor arrived in.
    """
    return np.maximum(segment[targets], segment[targets + 1])


def window_start(dataset: str | Dataset, wanted: int, batch_size: int) -> int:
    """`wanted`, or the latest earlier part whose window holds at least one global batch of training
    examples (a small day is trained together with the days before it); 0 if none does."""
    if wanted == 0:
        return 0
    ds = dataset if isinstance(dataset, Dataset) else Dataset.open(dataset)
    targets = target_positions(ds.offsets(), "train")
    per_part = np.bincount(window_key(ds.event_segments(), targets), minlength=len(ds.segments))
    examples = np.cumsum(per_part[::-1])[::-1]  # examples[s]: training examples in the window from part s
    fits = np.flatnonzero(examples[: wanted + 1] >= batch_size)
    return int(fits[-1]) if fits.size else 0


def negative_seed(seed: int, epoch: int) -> int:
    """Negatives are drawn afresh every epoch; evaluation uses epoch -1."""
    return (seed * 1_000_003 + epoch + 1) & 0x7FFF_FFFF_FFFF_FFFF


def check_batch(batch_size: int, trainers: int, examples: int | None = None) -> None:
    """The one check of a global batch against the trainers it is split over (and the examples it is
    drawn from): every trainer gets at least one example, every epoch at least one step."""
    if batch_size < trainers:
        raise InputError(f"batch size {batch_size} < {trainers} trainers; accepted: batch size >= {trainers}, "
                         "one example per trainer")
    if examples is not None and batch_size > examples:
        raise InputError(f"batch size {batch_size} > {examples} training examples; accepted: at most {examples}")


def sub_batches(batch: np.ndarray, trainers: int) -> list[np.ndarray]:
    """One contiguous sub-batch per trainer, sizes differing by at most one (check_batch holds)."""
    return np.array_split(batch, trainers)


@dataclass
class Lookups:
    """One sub-batch's lookups: per table the ids to fetch and where each lookup finds its row."""

    fetch: dict  # table -> int64 ids to fetch (distinct with scope 'device', every occurrence with 'none')
    index: BatchIndex  # positions into the fetched rows


def lookups(ex: Examples, data: TrainData, config: ModelConfig, dedup: str) -> Lookups:
    """Which rows a trainer needs for `ex`; with scope `none` each occurrence is fetched on its own."""
    candidates = np.concatenate([ex.positive[:, None], ex.negatives], axis=1)
    valid = ex.history != PAD
    item_ids = np.concatenate([ex.history[valid], candidates.reshape(-1)])
    per_table = {data.item: item_ids}
    for name in config.features:
        per_table[name] = data.columns[name][ex.position]
    fetch, where = {}, {}
    for name, ids in per_table.items():
        if dedup == "device":
            fetch[name], where[name] = np.unique(ids, return_inverse=True)
        else:
            fetch[name], where[name] = ids, np.arange(ids.size)
    n_hist = int(valid.sum())
    history = np.full(ex.history.shape, -1, dtype=np.int64)
    history[valid] = where[data.item][:n_hist]
    index = BatchIndex(
        history=history,
        candidates=where[data.item][n_hist:].reshape(candidates.shape),
        features={name: where[name] for name in config.features},
    )
    return Lookups(fetch=fetch, index=index)


def table_index(ex: Examples, data: TrainData, config: ModelConfig) -> BatchIndex:
    """Where each lookup of `ex` finds its row in whole tables (row = id): the reference trainer's index."""
    return BatchIndex(
        history=ex.history.astype(np.int64),  # PAD is -1
        candidates=np.concatenate([ex.positive[:, None], ex.negatives], axis=1).astype(np.int64),
        features={name: data.columns[name][ex.position] for name in config.features},
    )
