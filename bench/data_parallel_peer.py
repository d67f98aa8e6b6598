"""The data-parallel PyTorch peer: one plain PyTorch process per device, as PyTorch's DistributedDataParallel
trains a model whose tables fit every process.

Each of `processes` processes (spawned, one torch thread each) holds the whole model: shardflow's reference
trainer's tables, optimizer state and dense weights, initialised alike. A step takes the global batch of the
reference trainer (same order, same examples), computes its share (targets rank, rank + processes, ...) with
the reference's forward and backward (gradients scaled by the global batch), then sums across processes over a
gloo group on loopback: in one all-reduce, the dense gradients and each table of up to DENSE_SUM_BYTES as a dense
[rows, dim] with a count of the processes that read each row (as DDP sums a dense embedding's gradient); a larger
table's gradient as a sparse tensor, which gloo sums by gathering every process's rows (an nn.Embedding with
sparse=True). Each process then updates the rows some process read and the dense weights, with the reference's
optimizers: every process applies the same sums, so the replicas stay equal. Nothing is shared but those sums; a
sub-batch's examples are built by its own process.

What it answers: how fast this machine trains the model with one process per device and nothing sharded, the
way a PyTorch user whose tables fit every process would, beside the engine on as many devices.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shardflow.data.batches import negative_seed
from shardflow.data.clicks import load_training_data
from shardflow.model.configs import OptimizerConfig
from shardflow.model.forward import forward_backward, on_device
from shardflow.model.optim import row_update
from shardflow.training.reference import ReferenceTrainer

# A table of at most this many bytes is summed dense (with the rest, in one all-reduce), a larger one sparse (its
# rows read, gathered from every process): a PyTorch user's nn.Embedding with sparse=False or True. Each was the
# faster way on one side of it (2-core machine, 2 processes ÷ one process of 2 threads, 2 rounds each, batch 4,096):
# amazon-video's 6 MB table dense 0.89-0.99, sparse 0.75-0.87; the Zipf log's 25.6 MB dense 0.54-0.55, sparse 0.74-0.83.
DENSE_SUM_BYTES = 16 << 20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _parameters(trainer: ReferenceTrainer) -> dict[str, np.ndarray]:
    """A trainer's dense weights (as `dense/NAME`) and tables (by name), to compare two trainers."""
    return {**{f"dense/{k}": v for k, v in trainer.dense.items()}, **trainer.weights}


def _step(trainer: ReferenceTrainer, rank: int, world: int, epoch: int, step_in_epoch: int) -> None:
    """One global step: this process's share of the batch, the sums over every process, the same update."""
    config, B = trainer.config, trainer.batch_size
    targets = trainer.data.batch(epoch, trainer.seed, step_in_epoch, B)[rank::world]
    ex = trainer.data.examples(targets, config, negative_seed(trainer.seed, epoch), step=step_in_epoch)
    index = on_device(trainer.data.table_index(ex, config), trainer.device)
    grads = forward_backward(config, trainer.dense_tensors, trainer.tables, index, B * config.loss_terms, sparse=True)
    rows = {t: g.coalesce() for t, g in grads.rows.items()}
    large = [t for t in rows if trainer.tables[t].numel() * 4 > DENSE_SUM_BYTES]  # only the rows read travel
    small = [t for t in rows if t not in large]  # in the same order in every process, as the collectives need
    parts = [g.reshape(-1) for g in grads.dense.values()]
    for t in small:
        total = torch.zeros_like(trainer.tables[t])
        total.index_add_(0, rows[t].indices()[0], rows[t].values())
        read = torch.zeros(total.shape[0], dtype=torch.float32)  # 1 where this process read the row
        read[rows[t].indices()[0]] = 1.0
        parts += [total.reshape(-1), read]
    sums = torch.cat(parts)
    dist.all_reduce(sums)  # one call a step: every dense sum at once
    start = 0

    def take(shape: tuple[int, ...]) -> torch.Tensor:
        nonlocal start
        n = int(torch.Size(shape).numel())
        start += n
        return sums[start - n:start].view(shape)

    dense = {name: take(tuple(g.shape)) for name, g in grads.dense.items()}
    for t in small:
        total = take(tuple(trainer.tables[t].shape))
        at = torch.nonzero(take((total.shape[0],)), as_tuple=True)[0]
        row_update(trainer.optimizer, trainer.tables[t], trainer.row_state[t], at, total[at])
    for t in large:
        g = rows[t]
        dist.all_reduce(g)  # gloo sums a sparse tensor by gathering every process's rows
        g = g.coalesce()
        row_update(trainer.optimizer, trainer.tables[t], trainer.row_state[t], g.indices()[0], g.values())
    trainer.dense_optimizer.step(dense)


def _rank(rank: int, world: int, port: int, dataset: str, model: Any, optimizer: OptimizerConfig, batch_size: int,
          warmup: int, steps: int, out: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        data = load_training_data(dataset, model.features)
        trainer = ReferenceTrainer(data, model, optimizer, batch_size, seed=0)
        per_epoch = data.steps_per_epoch(batch_size)
        for i in range(warmup):
            _step(trainer, rank, world, *divmod(i, per_epoch))
        dist.barrier()
        t = time.perf_counter()
        for i in range(warmup, warmup + steps):
            _step(trainer, rank, world, *divmod(i, per_epoch))
        dist.barrier()
        if rank == 0:
            out.put((steps * batch_size / (time.perf_counter() - t), _parameters(trainer)))
    finally:
        dist.destroy_process_group()


def data_parallel_run(dataset: Path, model: Any, optimizer: OptimizerConfig, batch_size: int, warmup: int, steps: int,
                      processes: int = 2) -> tuple[float, dict[str, np.ndarray]]:
    """Examples/s of `processes` data-parallel PyTorch processes over `steps` steps after `warmup` (their start-up,
    imports and data loading not counted), on `dataset` (a sequence log's store or a click log's, its training
    data as a run loads it); and the first process's parameters after them (dense weights as `dense/NAME`, tables
    by name)."""
    context = mp.get_context("spawn")
    out = context.SimpleQueue()
    env = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # the spawned processes' OpenMP: one thread each, as the engine's devices
    try:
        ranks = mp.start_processes(_rank, args=(processes, _free_port(), str(dataset), model, optimizer,
                                                batch_size, warmup, steps, out),
                                   nprocs=processes, join=False, start_method="spawn")
    finally:
        if env is None:
            os.environ.pop("OMP_NUM_THREADS")
        else:
            os.environ["OMP_NUM_THREADS"] = env
    result = None
    while not ranks.join(timeout=0.1):  # raises if a process failed; the result read as it comes: a pipe holds
        if result is None and not out.empty():  # only so much, and its writer waits until it is read
            result = out.get()
    if result is None and out.empty():
        raise RuntimeError("the data-parallel peer's processes ended without a result")
    return out.get() if result is None else result


def largest_difference(dataset: Path, model: Any, optimizer: OptimizerConfig, batch_size: int, steps: int) -> float:
    """The largest absolute difference between any parameter of the peer on 2 processes and of the reference
    trainer after the same `steps` steps (none timed): that the peer trains the model the others train. Few steps:
    Adagrad's first update of a row scales its gradient to about the learning rate whatever its size, so a row
    first read with a gradient near zero moves by its rounding (1e-3 after 12 steps on amazon-video, 6e-8 after 2)."""
    _, params = data_parallel_run(dataset, model, optimizer, batch_size, steps, 0)
    data = load_training_data(dataset, model.features)
    ref = ReferenceTrainer(data, model, optimizer, batch_size, seed=0)
    per_epoch = data.steps_per_epoch(batch_size)
    for i in range(steps):
        ref.step(*divmod(i, per_epoch))
    return max(float(np.abs(params[k] - v).max()) for k, v in _parameters(ref).items())
