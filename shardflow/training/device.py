"""One device: its parameter shard and its trainer, run as one Dask actor per device.

A step is up to three rounds the engine starts on every device at once; each round ends
on all devices before the next begins, and nothing is written before the last:

  compute       the trainer builds its sub-batch, reads rows held on this device
                directly, pulls the rest grouped per owning device, runs forward and
                backward, and pushes each row's gradient to the copy it read (its own
                shard without a network call) and the dense gradients to device 0; the
                partial sums of global rows go to the node's leader;
  to_primaries  (several nodes, replicated rows) each non-primary node's copy passes its
                node's partial sum to the primary copy (the row's home);
  apply         every home sums the contributions in sender order and applies the update
                to the rows it owns; for replicated rows it sends the total to the other
                nodes' copies (and, for global rows, to the devices of its node), whose
                leaders pass it on inside their nodes; every copy applies the same total.

Methods that serve other devices are coroutines, so Dask runs them on the worker's event
loop while the actor's thread is busy with a round: no round can deadlock on another.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import zarr

from shardflow.arrays import array_module, to_device, to_host
from shardflow.errors import InputError, TrainingError, WorkerLost
from shardflow.model import ModelConfig, forward_backward, scores
from shardflow.optim import OptimizerConfig
from shardflow.planner.plan import GLOBAL, SINGLE, TablePlan, replica_device
from shardflow.planner.shardmap import ShardMap
from shardflow.planner.topology import Topology
from shardflow.training.batches import TrainData, lookups, negative_seed, sub_batches
from shardflow.training.evaluate import EVAL_CHUNK, hits
from shardflow.training.shard import ParameterShard, RowLayout
from storage.checkpoint import read_arrays, write_arrays


# A peer that has not answered for PROBE_S is asked whether it still exists: a call to an
# actor released meanwhile (its run ended or died) never returns in distributed 2026.8,
# and the waiting thread must not stay blocked (the worker's next actor would queue
# behind it). PEER_TIMEOUT_S bounds the wait even for a peer that exists but is stuck.
PROBE_S = 1.0
PEER_TIMEOUT_S = 300.0


def answer(call, peer):
    """The result of `call` to the actor `peer`; WorkerLost once the peer is gone or silent too long."""
    deadline = time.monotonic() + PEER_TIMEOUT_S
    while True:
        try:
            return call.result(timeout=PROBE_S)
        except TimeoutError:
            try:
                peer.alive
            except Exception as e:  # KeyError (actor released), OSError (worker gone), RuntimeError (lost)
                raise WorkerLost(f"a peer device is gone ({type(e).__name__}: {e})") from None
            if time.monotonic() > deadline:
                raise WorkerLost(f"no answer from a peer device in {PEER_TIMEOUT_S:.0f} s") from None


class DeviceWorker:
    alive = True  # an attribute, not a method: reading it remotely fails at once if the actor is gone
    def __init__(
        self,
        device: int,
        topology: Topology,
        tables: dict[str, TablePlan],
        dataset: str,
        config: ModelConfig,
        optimizer: OptimizerConfig,
        *,
        batch_size: int,
        dedup: str,
        array_device: str = "cpu",
        scaled_rows: dict[str, int] | None = None,
        window: tuple[int, int] = (0, 0),
    ) -> None:
        self.device, self.topology = device, topology
        self.node = int(topology.node_of_device[device])
        self.config, self.batch_size, self.dedup = config, batch_size, dedup
        self.xp = array_module(array_device)
        self.data = TrainData.load(dataset, config.features, window)
        self.tables = tables
        self.maps = {t: ShardMap(plan, topology) for t, plan in tables.items()}
        if scaled_rows is None:
            layouts = {t: RowLayout(t, stored=m.stored(device)) for t, m in self.maps.items()}
        else:
            empty = np.zeros(0, dtype=np.int64)
            layouts = {
                t: RowLayout(t, modulus=scaled_rows[t]) if device == 0 else RowLayout(t, stored=empty) for t in tables
            }
        self.shard = ParameterShard(
            device, topology.devices, layouts, config, optimizer, self.xp, holds_dense=device == 0
        )
        self._order: tuple[int, np.ndarray] | None = None
        self.peers: list = []

    def connect(self, peers: list) -> int:
        self.peers = peers
        return self.device

    # -- serving other devices (coroutines: run on the worker's event loop) ----------------
    async def pull(self, table: str, ids: np.ndarray, sender: int, step: int, kind: str = "lookup") -> np.ndarray:
        return self.shard.serve(table, ids, sender, step, kind)

    async def push(self, table: str, ids: np.ndarray, grads: np.ndarray, sender: int, kind: str = "lookup") -> None:
        self.shard.accept(table, ids, grads, sender, kind)

    async def pull_dense(self, sender: int, step: int, kind: str = "dense") -> dict:
        return self.shard.serve_dense(sender, step, kind)

    async def push_dense(self, grads: dict, sender: int) -> None:
        self.shard.accept_dense(grads, sender)

    async def receive_total(self, table: str, ids: np.ndarray, grads: np.ndarray, sender: int, step: int) -> None:
        """A replica's copy of the summed update; a node's leader passes global rows on inside its node."""
        self.shard.traffic["sync"][sender, self.device] += ids.nbytes + grads.nbytes
        self.shard.apply(table, ids, grads, step)
        if self.topology.node_of_device[sender] == self.node:
            return
        is_global = self.tables[table].tier[ids] == GLOBAL
        if is_global.any():
            for other in self._node_peers():
                await self.peers[other].receive_total(table, ids[is_global], grads[is_global], self.device, step)

    # -- the rounds of a step (run in the actor's thread) ------------------------------------
    def _node_peers(self) -> list[int]:
        start = int(self.topology.node_start[self.node])
        return [d for d in range(start, start + self.topology.node_devices[self.node]) if d != self.device]

    def _sub_batch(self, epoch: int, step_in_epoch: int, seed: int) -> np.ndarray:
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, self.data.epoch_order(epoch, seed))
        batch = self._order[1][step_in_epoch * self.batch_size : (step_in_epoch + 1) * self.batch_size]
        return sub_batches(batch, self.topology.devices)[self.device]

    def _fetch(self, table: str, ids: np.ndarray, step: int, kind: str):
        """Rows of `ids` from the copies this device reads: its own without a call, the rest per owner."""
        owner = self.maps[table].locate(ids, self.device)[0]
        xp = self.xp
        rows = xp.empty((ids.size, self.config.dim), dtype=np.float32)
        mine = np.flatnonzero(owner == self.device)
        rows[to_device(xp, mine)] = self.shard.read(table, ids[mine], step)
        calls = {}
        for peer in np.unique(owner[owner != self.device]):
            sel = np.flatnonzero(owner == peer)
            calls[int(peer)] = (sel, self.peers[peer].pull(table, ids[sel], self.device, step, kind))
        for peer, (sel, call) in calls.items():
            rows[to_device(xp, sel)] = to_device(xp, answer(call, self.peers[peer]))
        return rows, owner

    def _dense(self, step: int, kind: str = "dense") -> dict:
        if self.device == 0:
            return self.shard.dense
        got = answer(self.peers[0].pull_dense(self.device, step, kind), self.peers[0])
        return {k: to_device(self.xp, v) for k, v in got.items()}

    def compute(self, epoch: int, step_in_epoch: int, step: int, seed: int) -> dict:
        t0 = time.perf_counter()
        targets = self._sub_batch(epoch, step_in_epoch, seed)
        ex = self.data.examples(targets, self.config, negative_seed(seed, epoch))
        need = lookups(ex, self.data, self.config, self.dedup)
        t1 = time.perf_counter()
        dense = self._dense(step)
        rows, owners = {}, {}
        for table, ids in need.fetch.items():
            rows[table], owners[table] = self._fetch(table, ids, step, "lookup")
        t2 = time.perf_counter()
        norm = self.batch_size * (1 + self.config.negatives)
        grads = forward_backward(self.xp, self.config, dense, rows, need.index.on(self.xp), self.data.item, norm)
        self._check_finite(step, grads)
        t3 = time.perf_counter()
        calls = []
        for table, ids in need.fetch.items():
            g = grads.rows[table]
            owner = owners[table]
            mine = np.flatnonzero(owner == self.device)
            self.shard.accept(table, ids[mine], g[to_device(self.xp, mine)], self.device)
            for peer in np.unique(owner[owner != self.device]):
                sel = np.flatnonzero(owner == peer)
                calls.append((peer, self.peers[peer].push(table, ids[sel], to_host(g[to_device(self.xp, sel)]), self.device)))
        if self.device == 0:
            self.shard.accept_dense(grads.dense, 0)
        else:
            calls.append((0, self.peers[0].push_dense({k: to_host(v) for k, v in grads.dense.items()}, self.device)))
        for peer, call in calls:
            answer(call, self.peers[peer])
        self._to_leaders()
        t4 = time.perf_counter()
        return {
            "loss_sum": grads.loss_sum,
            "examples": int(targets.size),
            "batch_s": t1 - t0,
            "pull_s": t2 - t1,
            "compute_s": t3 - t2,
            "push_s": t4 - t3,
        }

    def _check_finite(self, step: int, grads) -> None:
        if not np.isfinite(grads.loss_sum):
            raise TrainingError(f"step {step}: the loss is {grads.loss_sum} on device {self.device}; stopped before any update")
        for name, g in list(grads.rows.items()) + list(grads.dense.items()):
            if not bool(self.xp.isfinite(g).all()):
                what = f"table '{name}'" if name in grads.rows else f"dense parameter '{name}'"
                raise TrainingError(
                    f"step {step}: non-finite gradient in {what} on device {self.device}; stopped before any update"
                )

    def _to_leaders(self) -> None:
        """This trainer's partial sums of global rows, to its node's leader of each row."""
        calls = []
        for table, plan in self.tables.items():
            ids, grads = self.shard.take(
                table,
                lambda ids, plan=plan: (plan.tier[ids] == GLOBAL) & (self._holder(plan, ids, self.node) != self.device),
            )
            calls += self._push_grouped(table, ids, grads, self._holder(plan, ids, self.node))
        for peer, call in calls:
            answer(call, self.peers[peer])

    def to_primaries(self, step: int) -> None:
        calls = []
        for table, plan in self.tables.items():
            ids, grads = self.shard.take(
                table, lambda ids, plan=plan: (plan.tier[ids] != SINGLE) & (plan.home[ids] != self.device)
            )
            if ids.size and (self._holder(plan, ids, self.node) != self.device).any():
                raise RuntimeError(f"device {self.device}: gradients of replicated rows it does not hold")
            calls += self._push_grouped(table, ids, grads, plan.home[ids])
        for peer, call in calls:
            answer(call, self.peers[peer])

    def apply(self, step: int) -> None:
        calls = []
        for table, plan in self.tables.items():
            ids, total = self.shard.take(table, lambda ids: np.ones(ids.size, dtype=bool))
            if ids.size and (plan.home[ids] != self.device).any():
                raise RuntimeError(f"device {self.device}: gradients left for rows it does not own")
            self.shard.apply(table, ids, total, step)
            replicated = np.flatnonzero(plan.tier[ids] != SINGLE)
            r_ids, r_total = ids[replicated], self._host(total, replicated)
            for node in range(len(self.topology.nodes)):
                if node == self.node:
                    continue
                holder = self._holder(plan, r_ids, node)
                for peer in np.unique(holder):
                    sel = holder == peer
                    calls.append((peer, self.peers[peer].receive_total(table, r_ids[sel], r_total[sel], self.device, step)))
            is_global = plan.tier[r_ids] == GLOBAL
            if is_global.any():
                for peer in self._node_peers():
                    calls.append(
                        (peer, self.peers[peer].receive_total(table, r_ids[is_global], r_total[is_global], self.device, step))
                    )
        if self.device == 0:
            self.shard.apply_dense(step)
        for peer, call in calls:
            answer(call, self.peers[peer])
        self.shard.finish_step(step)

    def discard(self) -> None:
        self.shard.discard()

    def _push_grouped(self, table: str, ids: np.ndarray, grads, dest: np.ndarray) -> list:
        """Partial sums to the device `dest` names for each id, one sync message per device."""
        calls = []
        for peer in np.unique(dest):
            sel = np.flatnonzero(dest == peer)
            calls.append((peer, self.peers[peer].push(table, ids[sel], self._host(grads, sel), self.device, "sync")))
        return calls

    def _host(self, grads, sel: np.ndarray) -> np.ndarray:
        return to_host(grads[to_device(self.xp, sel)])

    def _holder(self, plan: TablePlan, ids: np.ndarray, node: int) -> np.ndarray:
        return replica_device(plan.home[ids].astype(np.int64), self.topology, node)

    # -- evaluation and inspection -----------------------------------------------------------
    def evaluate(self, targets: np.ndarray, candidates: int, seed: int) -> dict:
        """Leave-last-out on `targets`: AUC against the first sampled negative, HR@10 among `candidates`."""
        step = self.shard.clock
        dense = self._dense(step, "eval")
        auc = hit = 0.0
        for s in range(0, targets.size, EVAL_CHUNK):
            ex = self.data.examples(targets[s : s + EVAL_CHUNK], self.config, seed, negatives=candidates - 1)
            need = lookups(ex, self.data, self.config, "device")
            rows = {t: self._fetch(t, ids, step, "eval")[0] for t, ids in need.fetch.items()}
            a, h = hits(to_host(scores(self.xp, self.config, dense, rows, need.index.on(self.xp), self.data.item)))
            auc, hit = auc + a, hit + h
        return {"auc_sum": auc, "hits": hit, "examples": int(targets.size)}

    # -- checkpoints and export ----------------------------------------------------------
    def _arrays(self) -> list[str]:
        names = [f"{t}/{f}" for t in self.shard.layouts for f in ("weights", "state", "version")]
        if self.shard.dense is not None:
            names += [f"dense/{k}" for k in self.shard.dense]
            names += [f"dense_opt/{k}" for k in self.shard.dense_optimizer.state]
        return names

    def save(self, path: str) -> dict:
        """Write this shard into checkpoint `path` (its own directory only); returns checksums and clock."""
        sh = self.shard
        arrays = {}
        for t in sh.layouts:
            arrays[f"{t}/weights"] = to_host(sh.weights[t])
            arrays[f"{t}/state"] = to_host(sh.state[t])
            arrays[f"{t}/version"] = sh.version[t]
        if sh.dense is not None:
            arrays.update({f"dense/{k}": to_host(v) for k, v in sh.dense.items()})
            arrays.update({f"dense_opt/{k}": to_host(v) for k, v in sh.dense_optimizer.state.items()})
        root = Path(path) / "shards" / str(self.device)
        out = {"digests": write_arrays(root, arrays, f"shards/{self.device}"), "clock": sh.clock}
        if sh.dense is not None:
            out["dense_steps"] = sh.dense_optimizer.t
        return out

    def load(self, path: str, digests: dict, clock: int, dense_steps: int) -> None:
        """Restore this shard from checkpoint `path`, verifying every array against `digests`."""
        sh, xp = self.shard, self.xp
        root = Path(path) / "shards" / str(self.device)
        arrays = read_arrays(root, self._arrays(), f"shards/{self.device}", digests)
        for t, lay in sh.layouts.items():
            w = arrays[f"{t}/weights"]
            if w.shape != (lay.rows, self.config.dim):
                raise InputError(
                    f"{root}/{t}/weights: shape {w.shape}; accepted: ({lay.rows}, {self.config.dim}) "
                    "(this plan's rows on the device, the model's dimension)"
                )
            sh.weights[t] = to_device(xp, w)
            sh.state[t] = to_device(xp, arrays[f"{t}/state"])
            sh.version[t] = arrays[f"{t}/version"]
        if sh.dense is not None:
            for k in sh.dense:
                v = arrays[f"dense/{k}"]
                if v.shape != sh.dense[k].shape:
                    raise InputError(f"{root}/dense/{k}: shape {v.shape}; accepted: {sh.dense[k].shape}")
                sh.dense[k] = to_device(xp, v)
            sh.dense_optimizer.state = {k: to_device(xp, arrays[f"dense_opt/{k}"]) for k in sh.dense_optimizer.state}
            sh.dense_optimizer.t = dense_steps
        sh.clock = clock

    def warm_start(self, model: str, rows: dict, dense_steps: int) -> None:
        """Take the rows this shard stores and their Adagrad sums, and (device 0) the dense layers and their
        optimiser, from the exported model at `model`.

        Called on a fresh shard: rows at or past the export's `rows[table]` were added since
        and keep their initial values and a zero sum; versions and the clock stay at zero.
        """
        sh, xp = self.shard, self.xp
        for t, lay in sh.layouts.items():
            ids = lay.init_ids
            known = np.flatnonzero(ids < rows.get(t, 0))
            if not known.size:
                continue
            known = known[np.argsort(ids[known], kind="stable")]  # ascending ids read each chunk once
            for kind, target in (("tables", sh.weights), ("state", sh.state)):
                values = to_host(target[t])
                arr = zarr.open_array(str(Path(model) / kind / t), mode="r")
                values[known] = arr.get_orthogonal_selection((ids[known],) + (slice(None),) * (arr.ndim - 1))
                target[t] = to_device(xp, values)
        if sh.dense is not None:
            for group, target in (("dense", sh.dense), ("dense_opt", sh.dense_optimizer.state)):
                for k in target:
                    v = zarr.open_array(str(Path(model) / group / k), mode="r")[...]
                    if v.shape != tuple(target[k].shape):
                        raise InputError(f"{model}/{group}/{k}: shape {v.shape}; accepted: {tuple(target[k].shape)}")
                    target[k] = to_device(xp, v)
            sh.dense_optimizer.t = dense_steps

    async def export_rows(self, table: str, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Current rows of `ids` and their Adagrad sums, for the parameter download (training is over)."""
        local = to_device(self.xp, self.shard.layouts[table].local(ids))
        return to_host(self.shard.weights[table][local]), to_host(self.shard.state[table][local])

    def dense_parameters(self) -> tuple[dict, dict, int]:
        """(dense layers, their optimiser state, its step count), on the host."""
        opt = self.shard.dense_optimizer
        return ({k: to_host(v) for k, v in self.shard.dense.items()}, {k: to_host(v) for k, v in opt.state.items()},
                opt.t)

    def traffic(self) -> dict:
        return {k: v.copy() for k, v in self.shard.traffic.items()}

    def parameters(self) -> dict:
        """Everything this shard stores, on the host: for tests and the reference comparison."""
        out = {
            t: {
                "ids": lay.init_ids,
                "weights": to_host(self.shard.weights[t]),
                "state": to_host(self.shard.state[t]),
                "version": self.shard.version[t].copy(),
            }
            for t, lay in self.shard.layouts.items()
        }
        if self.shard.dense is not None:
            out["dense"] = {k: to_host(v) for k, v in self.shard.dense.items()}
        return out
