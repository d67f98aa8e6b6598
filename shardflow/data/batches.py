"""Global batches in a deterministic order, their split into sub-batches, and what each looks up.

The data streams: a trainer holds the users' offsets, the count of training targets in
each block of ORDER_BLOCK_EVENTS events, and its own part of the blocks its current
batches read (at most a few shuffle groups); never a column of the whole log. Every
trainer derives the epoch's order itself, so no batch travels over the network: a
seeded permutation of the blocks, cut into groups of SHUFFLE_BLOCKS, each group's
targets permuted together (seeded by the epoch and group). A batch thus draws from
SHUFFLE_BLOCKS places of the log. An epoch has floor(targets / batch_size) steps; the
rest of the order is left for that epoch.

A global batch is split by where its targets lie: each block is dealt to the trainers in
runs of at most PART_EVENTS events, in turn (at least RUNS_PER_PART runs each where the
block is long enough), and a trainer's sub-batch is the batch's targets in its runs (in
the batch's order). A trainer thus holds only its own part of each block it reads, 1 /
trainers of it (and each run's history tail); the runs are short, so every part samples
the whole block and no trainer's part leans to some users or some rows. Sub-batch sizes
vary around batch_size / trainers as the batch falls (a sub-batch may be empty). The
global batch, and so the model trained, does not depend on the split.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from shardflow.data.examples import (
    PAD,
    Examples,
    count_train_targets,
    examples_from,
    held_out_positions,
    sample_unseen,
    step_key,
    target_positions,
    validation_positions,
)
from shardflow.data.windows import held_events, window_key, window_targets
from shardflow.errors import InputError
from shardflow.model.configs import BatchIndex, ModelConfig
from shardflow.model.metrics import RankCounts
from storage.dataset import Dataset

ORDER_BLOCK_EVENTS = 1 << 20  # events per block of the epoch order (8 MB of int64 ids)
SHUFFLE_BLOCKS = 8  # blocks whose targets are shuffled together
CACHED_BLOCKS = 2 * SHUFFLE_BLOCKS + 2  # parts of blocks held: a batch may straddle two groups
USER_SPAN_GAP = 1 << 16  # users whose events lie closer are read together for evaluation (user_items)
PART_EVENTS = 1 << 10  # the longest run of a block's events dealt to one trainer
RUNS_PER_PART = 64  # runs are shortened (down to one event) until each trainer gets this many of a block
# A table of at most this many rows per id looked up is de-duplicated by marking its rows, not by sorting the ids:
# 51,000 Zipf ids of 24,000-400,000 rows in 0.10-0.27 ms against np.unique's 0.5-0.95; even at 4,000,000 rows
# (80 per id), 0.70 against 0.54 (2 cores).
MARKED_ROWS_PER_ID = 16


class EpochOrder:
    """The order of an epoch over training targets counted per block of `block_events` events:
    a seeded permutation of the blocks, cut into groups of SHUFFLE_BLOCKS, each group's
    targets permuted together. Subclasses say which targets a block holds (block_targets)."""

    dataset: Dataset
    blocks: int
    block_events: int
    events: int
    targets_per_block: np.ndarray
    targets: int
    parts: int = 1  # a block is read in this many parts (read_in_parts): one per trainer, 1 elsewhere
    _cache: OrderedDict[tuple[int, int], HeldPart]  # (block, part) -> what the part's reader holds
    # (epoch, seed, its block groups, their cumulative target counts)
    _epoch: tuple[int, int, list[np.ndarray], np.ndarray] | None = None
    _groups: OrderedDict[int, np.ndarray]  # an epoch's shuffled groups of targets, the last two made
    validation: bool = False  # whether a validation split is held out of training

    @property
    def columns(self) -> tuple[str, ...]:
        """The columns of the store a trainer reads its examples from."""
        raise NotImplementedError

    @property
    def _epoch_order(self) -> tuple[int, int, list[np.ndarray], np.ndarray]:
        if self._epoch is None:
            raise RuntimeError("no epoch order made yet (_group makes it)")
        return self._epoch

    def _check_validation(self) -> None:
        if not self.validation:
            raise InputError("no validation split was held out; accepted: data loaded with validation=True")

    def block_targets(self, block: int) -> np.ndarray:
        raise NotImplementedError

    def train_targets(self) -> np.ndarray:
        """Every training target, ascending (for small datasets and tests: it is one int64 per target)."""
        return np.concatenate([self.block_targets(b) for b in range(self.blocks)])

    def steps_per_epoch(self, batch_size: int) -> int:
        return self.targets // batch_size

    def read_in_parts(self, parts: int) -> None:
        """Hold only one part of each block read from now on (a trainer's device: one part per trainer)."""
        if parts != self.parts:
            self.parts, self._cache = parts, OrderedDict()

    def _run_events(self, block_length: int | np.ndarray, parts: int) -> np.ndarray:
        """How many consecutive events of a block of `block_length` events go to one trainer in turn."""
        if parts == 1:
            return np.maximum(block_length, 1)
        return np.clip(block_length // (RUNS_PER_PART * parts), 1, PART_EVENTS)

    def part_of(self, targets: np.ndarray, parts: int) -> np.ndarray:
        """The part (of `parts`) of its block that holds each target: its run's turn."""
        start = targets // self.block_events * self.block_events
        runs = self._run_events(np.minimum(self.block_events, self.events - start), parts)
        return np.asarray((targets - start) // runs % parts)

    def runs(self, block: int, part: int) -> tuple[np.ndarray, np.ndarray]:
        """(first, stop) of each run of events of `block` in `part` (of `parts`)."""
        start = block * self.block_events
        n = min(self.block_events, self.events - start)
        run = int(self._run_events(n, self.parts))
        firsts = start + np.arange(part * run, n, self.parts * run, dtype=np.int64)
        return firsts, np.minimum(firsts + run, start + n)

    def held_bytes(self, trainers: int) -> int:
        """The most a trainer's cache of parts holds: CACHED_BLOCKS parts of the columns it reads (without the
        runs' history tails, at most history / PART_EVENTS more)."""
        event_bytes = sum(self.dataset.event_bytes(c) for c in self.columns)
        return CACHED_BLOCKS * -(-min(self.block_events, self.events) // trainers) * event_bytes

    def sub_batches(self, batch: np.ndarray, trainers: int) -> list[np.ndarray]:
        """One sub-batch per trainer: the batch's targets in that trainer's part of their blocks."""
        owner = self.part_of(batch, trainers)
        return [batch[owner == d] for d in range(trainers)]

    def _parts_of(self, targets: np.ndarray) -> list[tuple[int, int, np.ndarray]]:
        """(block, part, which targets) for each part of a block (of `parts`) that `targets` lie in."""
        key = targets // self.block_events * self.parts + self.part_of(targets, self.parts)
        return [(k // self.parts, k % self.parts, key == k) for k in np.unique(key).tolist()]

    def _column(self, path: str, start: int, stop: int) -> np.ndarray:
        raise NotImplementedError

    def _part(self, block: int, part: int, tail: int) -> HeldPart:
        """One part of a block as this reader holds it: its runs, each with the `tail` events before it (which
        histories reach back to), of every one of `columns` (tables by their names); cached."""
        held = self._cache.get((block, part))
        if held is None or held.tail < tail:
            firsts, stops = self.runs(block, part)
            window = max(block * self.block_events - tail, 0)
            lo = np.maximum(firsts - tail, window)
            sizes = stops - lo
            base = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
            whole = firsts.size == 1 and lo[0] == window  # one run: the block itself, no copy
            keep = None if whole else np.repeat(lo - window - base, sizes) + np.arange(int(sizes.sum()))
            read = (self._column(c, window, int(stops[-1])) for c in self.columns)  # a column's block at a time
            columns = {c.removeprefix("tables/"): v if whole else v[keep]
                       for c, v in zip(self.columns, read, strict=True)}
            held = self._cache[block, part] = HeldPart(tail, firsts, lo - base, columns)
            while len(self._cache) > CACHED_BLOCKS:
                self._cache.popitem(last=False)
        self._cache.move_to_end((block, part))
        return held

    def _group(self, epoch: int, seed: int, group: int) -> np.ndarray:
        if self._epoch is None or self._epoch[:2] != (epoch, seed):
            perm = np.random.default_rng([seed, epoch]).permutation(self.blocks)
            groups = [perm[g : g + SHUFFLE_BLOCKS] for g in range(0, self.blocks, SHUFFLE_BLOCKS)]
            ends = np.cumsum([int(self.targets_per_block[g].sum()) for g in groups])
            self._epoch, self._groups = (epoch, seed, groups, ends), OrderedDict()
        if group not in self._groups:
            targets = np.concatenate([self.block_targets(int(b)) for b in self._epoch_order[2][group]])
            self._groups[group] = np.random.default_rng([seed, epoch, group]).permutation(targets)
            while len(self._groups) > 2:
                self._groups.popitem(last=False)
        return self._groups[group]

    def batch(self, epoch: int, seed: int, step_in_epoch: int, batch_size: int) -> np.ndarray:
        """The targets of one global batch: positions step*B .. (step+1)*B of the epoch's order."""
        first, stop = step_in_epoch * batch_size, (step_in_epoch + 1) * batch_size
        self._group(epoch, seed, 0)
        ends = self._epoch_order[3]
        parts, g = [], int(np.searchsorted(ends, first, side="right"))
        while first < stop and g < len(ends):
            begin = int(ends[g - 1]) if g else 0
            targets = self._group(epoch, seed, g)
            parts.append(targets[first - begin : stop - begin])
            first, g = begin + targets.size, g + 1
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def sequence_table(ds: Dataset) -> str:
    """The dataset's item-sequence table; an InputError for a dataset without one (a click log)."""
    if ds.info.sequence_table is None:
        raise InputError(
            f"dataset {ds.path} has no item sequence (tables {', '.join(ds.info.table_names)}); "
            "accepted: a dataset imported from sasrec, s3rec or recbole, or made by 'shardflow synth'"
        )
    return ds.info.sequence_table


class TrainData(EpochOrder):
    """A dataset as its trainers read it: the order of an epoch, and the examples of any targets."""

    scored = RankCounts  # what its scored held-out examples add up to

    def __init__(self, ds: Dataset, features: tuple[str, ...], window: tuple[int, int],
                 block_events: int = ORDER_BLOCK_EVENTS, validation: bool = False) -> None:
        self.dataset, self.features, self.window, self.block_events = ds, tuple(features), window, block_events
        self.validation = validation
        self.held = held_events(validation)  # each user's last events kept out of training
        self.item = sequence_table(ds)
        self.rows = {t: ds.info.table(t).rows for t in (self.item, *self.features)}
        self.offsets = ds.offsets()
        self.events = int(self.offsets[-1])
        self.blocks = -(-self.events // block_events)
        self._eval_targets = None  # every user's held-out event unless a window selects some: computed on demand
        if any(window):
            counts, keep = np.zeros(self.blocks, dtype=np.int64), []
            held_out = held_out_positions(self.offsets)
            for b in range(self.blocks):
                segments = self._segments(b)  # read once for both the targets and the held-out ones
                counts[b] = self.block_targets(b, segments).size
                lo, hi = np.searchsorted(held_out, [b * block_events, (b + 1) * block_events])
                here = held_out[lo:hi]
                keep.append(here[segments[here - b * block_events] >= window[1]])
            self.targets_per_block, self._eval_targets = counts, np.concatenate(keep)
        else:
            bounds = np.minimum(np.arange(self.blocks + 1, dtype=np.int64) * block_events, self.events)
            self.targets_per_block = count_train_targets(self.offsets, bounds, held=self.held)
        self.targets = int(self.targets_per_block.sum())
        self._cache = OrderedDict()  # (block, part) -> its HeldPart

    @classmethod
    def load(cls, dataset: str | Dataset, features: tuple[str, ...] = (), window: tuple[int, int] = (0, 0),
             block_events: int = ORDER_BLOCK_EVENTS, validation: bool = False) -> TrainData:
        """The dataset's training data; `window` = (first segment trained on, first segment evaluated on);
        `validation`: each evaluated user's second-to-last event is held out of training as well.

        A model version trains on the events of the newest parts (and on each user's last
        event before them, which the earlier version held out) and is evaluated on the
        held-out last items that lie in them, while users' earlier events still serve as
        history: windows select targets, never history.
        """
        ds = dataset if isinstance(dataset, Dataset) else Dataset.open(dataset)
        item = sequence_table(ds)
        unknown = [f for f in features if f not in ds.info.table_names or f == item]
        if unknown:
            accepted = list(ds.info.feature_tables)
            raise InputError(f"feature tables {unknown}; accepted: {', '.join(accepted) or 'none in this dataset'}")
        data = cls(ds, features, window, block_events, validation)
        if data.targets == 0:
            where = f" in parts {window[0] + 1}.. (the training window)" if window[0] else ""
            last = "the last two (validation and test)" if validation else "the last"
            raise InputError(f"dataset {ds.path}: no training examples{where} (a user's examples are their "
                             f"events after the first and before {last})")
        return data

    @property
    def offset_users(self) -> int:
        """Users whose offsets a trainer holds (the worker memory check counts them)."""
        return self.offsets.size - 1

    @property
    def eval_targets(self) -> np.ndarray:
        """The held-out (last) event of every user evaluated, ascending: one int64 per user, made when asked
        (the flow's evaluation), not held by every trainer."""
        return held_out_positions(self.offsets) if self._eval_targets is None else self._eval_targets

    @property
    def validation_targets(self) -> np.ndarray:
        """The second-to-last event of every evaluated user with three or more, ascending; only with a
        validation split (otherwise it is a training target)."""
        self._check_validation()
        return validation_positions(self.eval_targets, self.offsets)

    # -- targets and the order of an epoch ---------------------------------------------------
    def _segments(self, block: int) -> np.ndarray:
        """The segment of events block*B .. (block+1)*B, and of the `held` after (window_key reads them)."""
        start = block * self.block_events
        return self.dataset.event_segments(start, min(start + self.block_events + self.held, self.events))

    def block_targets(self, block: int, segments: np.ndarray | None = None) -> np.ndarray:
        """The training targets (absolute event indices, ascending) in one block; `segments`, if the
        caller has read them already, are the block's _segments."""
        start = block * self.block_events
        if not any(self.window):
            return target_positions(self.offsets, "train", start, start + self.block_events, self.held)
        return window_targets(self.dataset, self.offsets, start, start + self.block_events, self.window[0], segments,
                              self.held)

    # -- examples ----------------------------------------------------------------------------
    @property
    def columns(self) -> tuple[str, ...]:
        return tuple(f"tables/{t}" for t in (self.item, *self.features))

    def _column(self, path: str, start: int, stop: int) -> np.ndarray:
        return self.dataset.column(path, start, stop)  # in user order: a user's events one after the other

    def _gather(self, table: str, tail: int) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
        def gather(targets: np.ndarray, positions: np.ndarray) -> np.ndarray:
            out = np.empty(positions.shape, dtype=np.int64)
            for block, part, sel in self._parts_of(targets):
                held = self._part(block, part, tail)
                out[sel] = held.columns[table][held.at(targets[sel], positions[sel])]
            return out
        return gather

    def examples(self, targets: np.ndarray, config: ModelConfig, seed: int, negatives: int | None = None,
                 step: int | None = None) -> Examples:
        """The examples of `targets`, negatives drawn by `seed`; `step`: the training step in its epoch they
        belong to (its key, step_key(seed, step), keys the item dropout's row masks)."""
        targets = np.asarray(targets, dtype=np.int64)
        ex = examples_from(self.offsets, self._gather(self.item, config.history), targets, self.rows[self.item],
                           history=config.history, negatives=config.negatives if negatives is None else negatives,
                           seed=seed)
        for name in config.features:
            ex.features[name] = self._gather(name, config.history)(targets, targets[:, None])[:, 0]
        return ex if step is None else replace(ex, step_key=step_key(seed, step))

    def lookups(self, ex: Examples, config: ModelConfig, dedup: str) -> Lookups:
        """Which rows a trainer needs for `ex` (the history, the candidates, the features) and where each
        lookup finds its row among them."""
        candidates = np.concatenate([ex.positive[:, None], ex.negatives], axis=1)
        valid = ex.history != PAD
        per_table = {self.item: np.concatenate([ex.history[valid], candidates.reshape(-1)]),
                     **{name: ex.features[name] for name in config.features}}
        fetch, where = {}, {}
        for name, ids in per_table.items():
            fetch[name], where[name] = fetched(ids, dedup, self.rows[name])
        n_hist = int(valid.sum())
        history = np.full(ex.history.shape, -1, dtype=np.int64)
        history[valid] = where[self.item][:n_hist]
        index = BatchIndex(item=self.item, history=history,
                           candidates=where[self.item][n_hist:].reshape(candidates.shape),
                           features={name: where[name] for name in config.features}, keys=ex.key,
                           catalog=self.rows[self.item], item_ids=fetch[self.item], step_key=ex.step_key)
        return Lookups(fetch=fetch, index=index)

    def table_index(self, ex: Examples, config: ModelConfig) -> BatchIndex:
        """Where each lookup of `ex` finds its row in whole tables (row = id): the reference trainer's index. With
        item dropout, a training step's item lookups index the distinct rows it reads, as a trainer's do (the
        reference takes those rows from the whole table and drops each once: shardflow.model.sequence)."""
        index = BatchIndex(
            item=self.item,
            history=ex.history.astype(np.int64),  # PAD is -1
            candidates=np.concatenate([ex.positive[:, None], ex.negatives], axis=1).astype(np.int64),
            features={name: ex.features[name] for name in config.features},
            keys=ex.key,
            catalog=self.rows[self.item],
        )
        if not config.item_dropout or ex.step_key is None:
            return index
        held = self.lookups(ex, config, "device").index
        return replace(index, history=held.history, candidates=held.candidates, item_ids=held.item_ids,
                       step_key=ex.step_key)

    # -- evaluation: leave-last-out ------------------------------------------------------------
    def eval_examples(self, targets: np.ndarray, config: ModelConfig, seed: int, negatives: int) -> Examples:
        """The held-out targets, each with `negatives` sampled among the items its user never interacted with up
        to and including it."""
        ex = self.examples(targets, config, seed, negatives=0)
        seen, seen_offsets = self.user_items(ex.position)
        return replace(ex, negatives=sample_unseen(ex.position, seen, seen_offsets, self.rows[self.item], negatives,
                                                   seed), key=None)

    def user_items(self, targets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Every item the user of each target interacted with up to and including it (a user's last event: all
        of them), as flat ids and offsets (one range per target).

        Users near each other (under USER_SPAN_GAP events apart) are read as one span, so a chunk
        of all users costs one read and a sparse sample its users' events, never the log.
        """
        targets = np.asarray(targets, dtype=np.int64)
        user = np.searchsorted(self.offsets, targets, side="right") - 1
        starts, stops = self.offsets[user], targets + 1
        bounds = np.zeros(targets.size + 1, dtype=np.int64)
        np.cumsum(stops - starts, out=bounds[1:])
        out = np.empty(int(bounds[-1]), dtype=np.int64)
        order = np.argsort(starts, kind="stable")
        new_span = np.ones(order.size, dtype=bool)
        new_span[1:] = starts[order[1:]] - np.maximum.accumulate(stops[order])[:-1] > USER_SPAN_GAP
        for span in np.split(order, np.flatnonzero(new_span)[1:]):
            lo, hi = int(starts[span].min()), int(stops[span].max())
            lengths = stops[span] - starts[span]
            within = np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths, lengths)
            out[np.repeat(bounds[span], lengths) + within] = self._column(f"tables/{self.item}", lo, hi)[
                np.repeat(starts[span] - lo, lengths) + within]
        return out, bounds

def window_start(dataset: str | Dataset, wanted: int, batch_size: int, validation: bool = False) -> int:
    """`wanted`, or the latest earlier part whose window holds at least one global batch of training
    examples (a small day is trained together with the days before it); 0 if none does."""
    if wanted == 0:
        return 0
    ds = dataset if isinstance(dataset, Dataset) else Dataset.open(dataset)
    data = TrainData(ds, (), (0, 0), validation=validation)
    per_part = np.zeros(len(ds.segments), dtype=np.int64)
    for b in range(data.blocks):  # block by block: the log is never held whole
        start = b * data.block_events
        key = window_key(data._segments(b), data.block_targets(b) - start, data.held)
        per_part += np.bincount(key, minlength=len(ds.segments))
    examples = np.cumsum(per_part[::-1])[::-1]  # examples[s]: training examples in the window from part s
    fits = np.flatnonzero(examples[: wanted + 1] >= batch_size)
    return int(fits[-1]) if fits.size else 0


def negative_seed(seed: int, epoch: int) -> int:
    """Negatives are drawn afresh every epoch; evaluation uses epoch -1."""
    return (seed * 1_000_003 + epoch + 1) & 0x7FFF_FFFF_FFFF_FFFF


@dataclass
class HeldPart:
    """The columns of one part of a block: its runs one after the other, each with the tail before it."""

    tail: int  # events held before each run
    firsts: np.ndarray  # each run's first event
    shift: np.ndarray  # event - shift[run] = where that event is held
    columns: dict[str, np.ndarray]  # name -> values

    def at(self, targets: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Where the events `positions` (of the runs holding `targets`, or their tails) are held."""
        run = np.searchsorted(self.firsts, targets, side="right") - 1
        return np.asarray(positions - self.shift[run].reshape((-1,) + (1,) * (positions.ndim - 1)))


@dataclass
class Lookups:
    """One sub-batch's lookups: per table the ids to fetch and where each lookup finds its row."""

    fetch: dict[str, np.ndarray]  # table -> int64 ids to fetch (distinct with scope 'device', every one with 'none')
    index: Any  # positions into the fetched rows: a BatchIndex (sequences) or a ClickIndex (click logs)


def fetched(ids: np.ndarray, dedup: str, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """(the ids a trainer fetches, where each lookup finds its row among them): distinct ids with scopes
    device and node (a node's proxies de-duplicate again across its trainers), every occurrence with none.
    `rows`: the table's (every id is below it)."""
    if dedup not in ("device", "node"):
        return ids, np.arange(ids.size)
    if rows > MARKED_ROWS_PER_ID * ids.size:
        return np.unique(ids, return_inverse=True)
    seen = np.zeros(rows, dtype=bool)  # np.unique's answer, by marking the rows read instead of sorting the ids
    seen[ids] = True
    distinct = np.flatnonzero(seen)
    place = np.empty(rows, dtype=np.int64)
    place[distinct] = np.arange(distinct.size)
    return distinct, place[ids]
