"""One device: its parameter shard, its trainer and its side of the step protocol; no Dask.

A Device turns the protocol's events into work: `start` builds the device's sub-batch
of the global batch and its lookups, `receive` hands each round's messages to the
protocol and, once the rows are in (REPLY), runs the forward and backward in PyTorch.
Whatever carries the messages (the in-process driver, or the Dask engine's actors)
calls only these methods, so the same object trains in a test and on a cluster.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shardflow.data.batches import Lookups, TrainData, negative_seed
from shardflow.data.workload import Workload
from shardflow.errors import InputError, TrainingError
from shardflow.model.configs import ClickConfig, ModelConfig, OptimizerConfig
from shardflow.model.forward import Gradients, forward_backward, logits, on_device
from shardflow.model.metrics import Scored
from shardflow.model.ranking import CatalogRanks, UsersToRank, rank_block
from shardflow.model.tensors import Tensors
from shardflow.planner.sharding_plan import DevicePlan
from shardflow.planner.shardmap import ShardMap
from shardflow.planner.topology import Topology
from shardflow.training.evaluate import EVAL_CHUNK, RANK_BLOCK_ROWS, held_out_users
from shardflow.training.fusion import TableGroup
from shardflow.training.messages import (
    Apply,
    ApplyDense,
    Compute,
    EndStep,
    Instruction,
    Message,
    Round,
    Send,
    Traffic,
    to_host,
)
from shardflow.training.protocol import StepProtocol
from shardflow.training.rehome import rehome, shard_names
from shardflow.training.shard import ParameterShard, RowLayout
from shardflow.training.steps import Requests
from storage.checkpoint import read_arrays, read_export, read_export_dense, verify_arrays, write_arrays

DEVICES = ("cpu", "cuda")


def torch_device(name: str, index: int = 0) -> torch.device:
    """The torch device a shard computes on: `cpu`, or `cuda` (the worker's GPU)."""
    if name not in DEVICES:
        raise InputError(f"device {name!r}; accepted: {', '.join(DEVICES)}")
    if name == "cuda":
        if not torch.cuda.is_available():
            raise InputError("device 'cuda': no CUDA device is visible to PyTorch; accepted here: cpu")
        return torch.device("cuda", index % torch.cuda.device_count())
    return torch.device("cpu")


Arrays = dict[str, np.ndarray]  # name -> array, as checkpoints and exports store them
Digests = dict[str, str]  # array path -> its checksum (storage.checkpoint)
Outbox = dict[int, Message]  # peer -> the message of a round
Built = tuple[Lookups, int, float]  # a step's batch: its lookups, examples, and the seconds it took to build
WARM_START_ROWS = 1 << 19  # rows read from an export at a time


@dataclass(frozen=True)
class StepStats:
    """One device's figures of one step."""

    examples: int  # in its sub-batch
    loss_sum: float  # its examples' loss, summed over their terms (shardflow.model.sequence: loss)
    seconds: dict[str, float]  # part -> seconds: "batch" (building it), each round's name (its wait included),
    # "compute" (the forward and backward)

    @staticmethod
    def slowest(per_device: list[StepStats]) -> dict[str, float]:
        """Per part, the slowest device's seconds of one step."""
        return {part: max(s.seconds.get(part, 0.0) for s in per_device) for part in per_device[0].seconds}


class Device:
    def __init__(
        self,
        device: int,
        topology: Topology,
        tables: dict[str, DevicePlan],
        data: Workload,
        config: ModelConfig | ClickConfig,
        optimizer: OptimizerConfig,
        *,
        batch_size: int,
        dedup: str,
        array_device: str = "cpu",
        scaled_rows: dict[str, int] | None = None,
        early: bool = False,
        fuse: bool = True,
    ) -> None:
        self.index, self.topology, self.data, self.config = device, topology, data, config
        data.read_in_parts(topology.devices)  # this trainer reads its own part of each block
        self.batch_size, self.dedup = batch_size, dedup
        self.torch = torch_device(array_device, device)
        maps = {t: ShardMap(plan, topology) for t, plan in tables.items()}
        if scaled_rows is None:
            layouts = {t: RowLayout(t, stored=m.stored(device)) for t, m in maps.items()}
        else:
            empty = np.zeros(0, dtype=np.int64)
            layouts = {t: RowLayout(t, modulus=scaled_rows[t]) if device == 0 else RowLayout(t, stored=empty)
                       for t in tables}
        # a click log's small tables step as one (shardflow.training.fusion; `fuse` off: table by table, to compare);
        # not with scaled tables, whose rows are no plan's
        self.group = (TableGroup.of(tables, config.features, topology.devices)
                      if fuse and isinstance(config, ClickConfig) and scaled_rows is None else None)
        self.tables = tables
        self.shard = ParameterShard(device, layouts, config, optimizer, self.torch, holds_dense=device == 0,
                                    group=self.group)
        if self.group is not None:
            tables = self.group.step_plans(tables)
            maps = {t: maps[t] if t in maps else ShardMap(plan, topology) for t, plan in tables.items()}
        self.protocol = StepProtocol(device, topology, tables, self.shard, maps, dedup, early)
        self.rounds, self.round_peers = self.protocol.rounds, self.protocol.round_peers
        self._prepared: tuple[Requests, Lookups, int, float] | None = None
        self._seconds: dict[str, float] = {}  # the step under way's parts
        self._examples, self._loss_sum = 0, 0.0

    # -- a step ------------------------------------------------------------------------------
    def _sub_batch(self, epoch: int, step_in_epoch: int, seed: int) -> np.ndarray:
        batch = self.data.batch(epoch, seed, step_in_epoch, self.batch_size)
        return self.data.sub_batches(batch, self.topology.devices)[self.index]

    def build(self, epoch: int, step_in_epoch: int, seed: int) -> Built:
        """A step's sub-batch and lookups: reads the training data only (so a thread of its own may build the
        next step's while this device's thread runs a step; nothing else reads the data meanwhile)."""
        t0 = time.perf_counter()
        targets = self._sub_batch(epoch, step_in_epoch, seed)
        examples = self.data.examples(targets, self.config, negative_seed(seed, epoch), step=step_in_epoch)
        need = self._lookups(examples, self.dedup)
        return need, int(targets.size), time.perf_counter() - t0

    def _lookups(self, examples: Any, dedup: str) -> Lookups:
        """The rows `examples` read, with this device's tables fused as its shard stores them."""
        need = self.data.lookups(examples, self.config, dedup)
        return need if self.group is None else self.group.fuse(need)

    def prepare(self, epoch: int, step_in_epoch: int, step: int, seed: int, built: Built | None = None) -> Outbox:
        """Step `step`'s REQUEST messages ahead of its start, from its batch (`built` for it, or built now); the
        messages."""
        need, examples, batch_s = built if built is not None else self.build(epoch, step_in_epoch, seed)
        requests = self.protocol.requests(step, need.fetch)
        self._prepared = (requests, need, examples, batch_s)
        return requests.outbox

    def start(self, epoch: int, step_in_epoch: int, step: int, seed: int) -> Outbox:
        """Step `step` begins; its REQUEST outbox (the one `prepare` returned, if it was prepared)."""
        if self._prepared is None or self._prepared[0].step != step:
            self.prepare(epoch, step_in_epoch, step, seed)
        assert self._prepared is not None  # prepare sets it
        requests, self._need, examples, batch_s = self._prepared
        self._prepared = None
        out = self._carry_out(self.protocol.start(requests))
        self._mark = time.perf_counter()
        self._examples, self._loss_sum, self._seconds = examples, 0.0, {"batch": batch_s}
        return out

    def receive(self, round: Round, inbox: list[Message]) -> Outbox:
        out = self._carry_out(self.protocol.receive(round, inbox))
        now = time.perf_counter()
        self._seconds[round.value] = now - self._mark
        self._mark = now
        return out

    @property
    def early(self) -> bool:
        """Whether this device answers its peers' next REQUESTs early (protocol.py: PREFETCH)."""
        return self.protocol.early

    def answer_early(self, request: Message) -> Message:
        return self.protocol.answer_early(request)

    def take_early(self, answer: Message) -> None:
        self.protocol.take_early(answer)

    def table_plan(self, table: str) -> DevicePlan:
        return self.tables[table]

    def _carry_out(self, instructions: list[Instruction]) -> Outbox:
        """Carry out the protocol's instructions in order (this device's shard is written here, and only here);
        the messages to send, if any."""
        out: Outbox = {}
        for todo in instructions:
            if isinstance(todo, Apply):
                self.shard.apply(todo.table, todo.ids, todo.grads, todo.step)
            elif isinstance(todo, ApplyDense):
                self.shard.apply_dense(todo.grads)
            elif isinstance(todo, EndStep):
                self.shard.finish_step(todo.step)
            elif isinstance(todo, Compute):
                out = self._carry_out(self._compute(todo))
            elif isinstance(todo, Send):
                out = todo.outbox
        return out

    def _compute(self, work: Compute) -> list[Instruction]:
        t0 = time.perf_counter()
        norm = self.batch_size * self.config.loss_terms
        step = self.protocol.step
        grads = forward_backward(self.config, work.dense, work.rows, on_device(self._need.index, self.torch), norm)
        self._check_finite(step, grads)
        self._loss_sum = grads.loss_sum
        self._seconds["compute"] = time.perf_counter() - t0
        return self.protocol.gradients(grads.rows, grads.dense)

    def finish(self) -> StepStats:
        """This device's figures of the step just ended."""
        return StepStats(self._examples, float(self._loss_sum), dict(self._seconds))

    def abort(self) -> None:
        self.protocol.abort()
        self._prepared = None

    def failed(self, error: BaseException) -> Outbox | None:
        self._prepared = None
        return self.protocol.failed(error)

    @property
    def clock(self) -> int:
        """Steps applied on this device."""
        return self.shard.clock

    def _check_finite(self, step: int | None, grads: Gradients) -> None:
        if not np.isfinite(grads.loss_sum):
            raise TrainingError(
                f"step {step}: the loss is {grads.loss_sum} on device {self.index}; stopped before any update"
            )
        everything = list(grads.rows.items()) + list(grads.dense.items())
        if bool(torch.isfinite(torch.stack([g.sum() for _, g in everything])).all()):
            return  # a NaN or infinity anywhere makes its tensor's sum one
        for name, g in everything:
            if not bool(torch.isfinite(g).all()):
                what = f"table '{name}'" if name in grads.rows else f"dense parameter '{name}'"
                raise TrainingError(
                    f"step {step}: non-finite gradient in {what} on device {self.index}; stopped before any update"
                )

    # -- reads outside a step: evaluation and the parameter download ------------------------
    def serve_rows(self, table: str, ids: np.ndarray, sender: int) -> np.ndarray:
        """Rows for another device's evaluation (counted as `eval` traffic)."""
        rows = to_host(self.shard.read(table, ids))
        self.protocol.traffic.eval[sender, self.index] += ids.nbytes
        self.protocol.traffic.eval[self.index, sender] += rows.nbytes
        return rows

    def serve_dense(self, sender: int) -> Arrays:
        params = self.dense_parameters()[0]
        if sender != self.index:
            self.protocol.traffic.eval[self.index, sender] += sum(v.nbytes for v in params.values())
        return params

    def evaluate(self, targets: np.ndarray, negatives: int, seed: int,
                 remote_rows: Callable[[int, str, np.ndarray], np.ndarray],
                 remote_dense: Callable[[], Arrays]) -> Scored:
        """The held-out `targets` scored, added up as the data's `scored` value (sequences: against `negatives`
        each).

        `remote_rows(peer, table, ids)` and `remote_dense()` read from the other devices.
        """
        dense = self._dense(remote_dense)
        parts = []
        for s in range(0, targets.size, EVAL_CHUNK):
            ex = self.data.eval_examples(targets[s : s + EVAL_CHUNK], self.config, seed, negatives)
            need = self._lookups(ex, "device")
            rows = self._rows(need.fetch, remote_rows)
            with torch.no_grad():
                logit = logits(self.config, dense, rows, on_device(need.index, self.torch))
            parts.append(self.data.scored.of(to_host(logit), ex))
        return sum(parts, self.data.scored())

    def users_to_rank(self, targets: np.ndarray, include_seen: bool,
                      remote_rows: Callable[[int, str, np.ndarray], np.ndarray],
                      remote_dense: Callable[[], Arrays]) -> tuple[UsersToRank, np.ndarray]:
        """The full-catalog ranking inputs of the held-out `targets` (this device's part of a split), made here
        from rows read where they live, on the host; and which of them are missed outright."""
        config, data = self._sequences()
        return held_out_users(data, config, self._dense(remote_dense), targets, include_seen,
                              lambda fetch: self._rows(fetch, remote_rows), self.torch)

    def rank_home(self, users: UsersToRank, remote_dense: Callable[[], Arrays]) -> CatalogRanks:
        """`users`' held-out items ranked among the item rows this device is home to (a replicated row counts at
        its home only), RANK_BLOCK_ROWS at a time: the counts, which add up over the devices."""
        config, data = self._sequences()
        dense = self._dense(remote_dense)
        plan = self.table_plan(data.item)
        every = np.arange(plan.rows, dtype=np.int64)
        home = every[plan.home_of(every) == self.index]
        here = UsersToRank(tuple(x.to(self.torch) for x in users.state), users.target,
                           users.target_score.to(self.torch), users.left_user, users.left_item)
        zeros = np.zeros(users.users, dtype=np.int64)
        blocks = (home[s : s + RANK_BLOCK_ROWS] for s in range(0, home.size, RANK_BLOCK_ROWS))
        return sum((rank_block(config, dense, here, ids, self.shard.read(data.item, ids)) for ids in blocks),
                   CatalogRanks(zeros, zeros, zeros.astype(bool)))

    def _sequences(self) -> tuple[ModelConfig, TrainData]:
        """This device's model and data, which a full-catalog ranking needs to be a sequence workload's."""
        if not isinstance(self.config, ModelConfig) or not isinstance(self.data, TrainData):
            raise InputError("full-catalog ranking of a click log; accepted: a sequence workload")
        return self.config, self.data

    def _dense(self, remote_dense: Callable[[], Arrays]) -> Tensors:
        """The dense layers: this shard's, or read from the device that holds them."""
        if self.shard.dense is not None:
            return self.shard.dense
        return {k: torch.from_numpy(v).to(self.torch) for k, v in remote_dense().items()}

    def _rows(self, fetch: dict[str, np.ndarray], remote_rows: Callable[[int, str, np.ndarray], np.ndarray]) -> Tensors:
        """The rows of `fetch`'s ids of each table, read here or from the device each is read from."""
        rows = {}
        for table, ids in fetch.items():
            owner = self.protocol.maps[table].read_from(ids, self.index)
            r = torch.empty((ids.size, self.config.dim), dtype=torch.float32, device=self.torch)
            mine = np.flatnonzero(owner == self.index)
            r[torch.from_numpy(mine).to(self.torch)] = self.shard.read(table, ids[mine])
            for peer in np.unique(owner[owner != self.index]).tolist():
                sel = np.flatnonzero(owner == peer)
                got = torch.from_numpy(remote_rows(peer, table, ids[sel]))
                r[torch.from_numpy(sel).to(self.torch)] = got.to(self.torch)
            rows[table] = r
        return rows

    def export_rows(self, table: str, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Current rows of `ids` and their optimizer state (training is over)."""
        return to_host(self.shard.read(table, ids)), to_host(self.shard.read_state(table, ids))

    def dense_parameters(self) -> tuple[Arrays, Arrays, int]:
        """(dense layers, their optimiser state, its step count), on the host."""
        opt = self.shard.dense_optimizer
        return ({k: to_host(v).copy() for k, v in self.shard.dense_layers.items()},
                {k: to_host(v).copy() for k, v in opt.state.items()}, opt.t)

    def traffic(self) -> Traffic:
        return self.protocol.traffic.copy()

    def parameters(self) -> dict[str, Any]:
        """Everything this shard stores, on the host: for tests and the reference comparison."""
        sh = self.shard
        out = {
            t: {"ids": lay.init_ids, "weights": to_host(sh.weights[t]).copy(), "state": to_host(sh.state[t]).copy(),
                "version": sh.version[t].copy()}
            for t, lay in sh.layouts.items()
        }
        if sh.dense is not None:
            out["dense"] = self.dense_parameters()[0]
        return out

    # -- checkpoints and warm starts -------------------------------------------------------
    def _arrays(self) -> list[str]:
        names = [f"{t}/{f}" for t in self.shard.layouts for f in ("weights", "state", "version")]
        if self.shard.dense is not None:
            names += [f"dense/{k}" for k in self.shard.dense]
            names += [f"dense_opt/{k}" for k in self.shard.dense_optimizer.state]
        return names

    def save(self, path: str) -> dict[str, Any]:
        """Write this shard into checkpoint `path` (its own directory only); returns checksums and clock."""
        sh = self.shard
        arrays: Arrays = {}
        for t in sh.layouts:
            arrays[f"{t}/weights"] = to_host(sh.weights[t])
            arrays[f"{t}/state"] = to_host(sh.state[t])
            arrays[f"{t}/version"] = sh.version[t]
            arrays[f"{t}/ids"] = sh.layouts[t].init_ids  # what another plan's shards look up (rehome)
        out: dict[str, Any] = {"clock": sh.clock}
        if sh.dense is not None:
            dense, dense_state, out["dense_steps"] = self.dense_parameters()
            arrays.update({f"dense/{k}": v for k, v in dense.items()})
            arrays.update({f"dense_opt/{k}": v for k, v in dense_state.items()})
        root = Path(path) / "shards" / str(self.index)
        out["digests"] = write_arrays(root, arrays, f"shards/{self.index}")
        return out

    def verify(self, path: str, digests: Digests, shard: int | None = None) -> None:
        """Check the arrays of checkpoint `path`'s shard `shard` (this device's by default) against `digests`
        (an InputError naming a bad one)."""
        k = self.index if shard is None else shard
        names = sorted(set(shard_names(digests, k)) | (set(self._arrays()) if k == self.index else set()))
        verify_arrays(Path(path) / "shards" / str(k), names, f"shards/{k}", digests)

    def restore(self, path: str, digests: Digests, shards_before: int, clock: int, dense_steps: int) -> bool:
        """Restore this shard from checkpoint `path` (every shard of it verified first): in place when the
        checkpoint's shard of this index stored exactly this device's rows, else from the shards of another plan
        (shardflow.training.rehome). Whether its rows moved."""
        if self._same_rows(path, digests, shards_before):
            self.load(path, digests, clock, dense_steps)
            return False
        rehome(self.shard, path, digests, shards_before, clock, dense_steps)
        return True

    def _same_rows(self, path: str, digests: Digests, shards_before: int) -> bool:
        if self.index >= shards_before:
            return False
        root = Path(path) / "shards" / str(self.index)
        for t, lay in self.shard.layouts.items():
            if f"shards/{self.index}/{t}/ids" not in digests:  # written before checkpoints carried ids
                return shards_before == self.topology.devices
            ids = read_arrays(root, [f"{t}/ids"], f"shards/{self.index}", digests)[f"{t}/ids"]
            if not np.array_equal(ids, lay.init_ids):
                return False
        return True

    def load(self, path: str, digests: Digests, clock: int, dense_steps: int) -> None:
        """Restore this shard from checkpoint `path` (verified first with `verify` on every device)."""
        sh = self.shard
        root = Path(path) / "shards" / str(self.index)
        into: Arrays = {}
        if self.torch.type == "cpu":  # read in place: a restore holds one shard, not two
            for t in sh.layouts:
                into.update({f"{t}/weights": sh.weights[t].numpy(), f"{t}/state": sh.state[t].numpy(),
                             f"{t}/version": sh.version[t]})
        else:
            into.update({f"{t}/version": sh.version[t] for t in sh.layouts})
        arrays = read_arrays(root, self._arrays(), f"shards/{self.index}", digests, into)
        for t in sh.layouts:
            if self.torch.type != "cpu":
                for kind, held in (("weights", sh.weights), ("state", sh.state)):
                    a = arrays[f"{t}/{kind}"]
                    if a.shape != tuple(held[t].shape):
                        raise InputError(f"{root}/{t}/{kind}: shape {a.shape}; accepted: {tuple(held[t].shape)} (the "
                                         "rows this plan puts on the device, the model's dimension, the rows' "
                                         "optimizer state)")
                    held[t].copy_(torch.from_numpy(a))  # in place: a fused table's rows are a view
        if sh.dense is not None:
            sh.load_dense({k: arrays[f"dense/{k}"] for k in sh.dense},
                          {k: arrays[f"dense_opt/{k}"] for k in sh.dense_optimizer.state}, dense_steps, str(root))
        sh.clock = clock

    def warm_start(self, model: str, rows: dict[str, int], dense_steps: int) -> None:
        """Take the rows this shard stores and their optimizer state, and (device 0) the dense layers and their
        optimiser, from the exported model at `model`.

        Called on a fresh shard: rows at or past the export's `rows[table]` were added since
        and keep their initial values and a zero state; versions and the clock stay at zero.
        """
        sh = self.shard
        for t, lay in sh.layouts.items():
            ids = lay.init_ids
            known = np.flatnonzero(ids < rows.get(t, 0))
            if not known.size:
                continue
            for a in range(0, known.size, WARM_START_ROWS):  # a block at a time: never a second copy of the shard
                part = known[a : a + WARM_START_ROWS]
                local = torch.from_numpy(part).to(self.torch)
                sh.weights[t][local] = torch.from_numpy(read_export(model, "tables", t, ids[part])).to(self.torch)
                sh.state[t][local] = torch.from_numpy(read_export(model, "state", t, ids[part])).to(self.torch)
        if sh.dense is not None:
            shapes = {k: tuple(p.shape) for k, p in sh.dense.items()}
            dense, dense_state = read_export_dense(model, shapes, list(sh.dense_optimizer.state))
            sh.load_dense(dense, dense_state, dense_steps, str(model))
