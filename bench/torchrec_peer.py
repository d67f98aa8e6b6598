"""TorchRec peer of the engine: the same model on 2 CPU ranks, for bench/train_throughput.py.

    python bench/torchrec_peer.py DATASET --batch-size 4096 --steps 20 [--ranks 2]

Prints one JSON line {"rate": examples/s} (steady state: after 2 warm-up steps), or
{"skipped": why} when torchrec cannot be imported. TorchRec is an optional peer, not a
dependency; it installs beside this project's pins in an environment of its own:

    python3.11 -m venv /tmp/trv && /tmp/trv/bin/pip install -c constraints.txt -e .
    /tmp/trv/bin/pip install 'fbgemm-gpu-cpu==1.9.*' && /tmp/trv/bin/pip install --no-deps 'torchrec==1.9.*'
    /tmp/trv/bin/pip install tensordict torchmetrics==1.0.3 tqdm pyre-extensions

The model is shardflow's (dim 64, history 20 mean-pooled, the positive and 4 sampled
negatives, the same MLP and BCE) on the same global batches split into the same
sub-batches: `DistributedModelParallel` over gloo, its planner constrained to a
row-wise plan, fbgemm's fused CPU kernels with exact row-wise Adagrad, Adam on the
MLP (data-parallel; TorchRec 1.9 lists row-wise sharding for cuda and tpu only, so the
sharder names it for the CPU too). The history is one pooled feature; each candidate column is a
feature of single-id bags of the same table.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import warnings
from itertools import pairwise

import numpy as np

WARMUP = 2


def _rank(rank: int, world: int, args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, PoolingType
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.distributed.types import ShardingEnv, ShardingType

    from shardflow.data.batches import TrainData, negative_seed
    from shardflow.model.configs import ModelConfig, OptimizerConfig

    warnings.filterwarnings("ignore")  # TorchRec's deprecation and planner notices, once per rank and call
    logging.getLogger("torchrec").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model_config, opt = ModelConfig(), OptimizerConfig()
    D, C = model_config.dim, 1 + model_config.negatives
    data = TrainData.load(args.dataset)
    features = ["history"] + [f"candidate{c}" for c in range(C)]
    ebc = EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name="item", embedding_dim=D, num_embeddings=data.rows[data.item],
                                   feature_names=features, pooling=PoolingType.MEAN)],
        device=torch.device("meta"),
    )

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ebc = ebc
            widths = [3 * D, *model_config.mlp]
            layers: list = []
            for a, b in pairwise(widths):
                layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
            self.mlp = torch.nn.Sequential(*layers, torch.nn.Linear(widths[-1], 1))

        def forward(self, kjt):
            pooled = self.ebc(kjt)
            h = pooled["history"]
            t = torch.stack([pooled[f"candidate{c}"] for c in range(C)], dim=1)
            hb = h[:, None, :].expand_as(t)
            return self.mlp(torch.cat([hb, t, hb * t], dim=2)).squeeze(-1)

    class RowWiseOnCPU(EmbeddingBagCollectionSharder):
        """TorchRec 1.9 offers row-wise sharding only for cuda and tpu; its CPU kernels run it over gloo as well."""

        def sharding_types(self, compute_device_type: str) -> list[str]:
            return [ShardingType.ROW_WISE.value]

    sharder = RowWiseOnCPU(fused_params={
        "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": opt.row_lr, "eps": opt.eps})
    model = Model()
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=world, compute_device="cpu"),
                                       constraints={"item": ParameterConstraints(sharding_types=["row_wise"])})
    plan = planner.collective_plan(model, [sharder], dist.GroupMember.WORLD)
    dmp = DistributedModelParallel(model, env=ShardingEnv.from_process_group(dist.GroupMember.WORLD), plan=plan,
                                   sharders=[sharder], device=torch.device("cpu"))
    dense = [p for n, p in dmp.named_parameters() if "ebc" not in n]
    dense_opt = torch.optim.Adam(dense, lr=opt.dense_lr, eps=opt.eps)
    norm = float(args.batch_size * C)

    per_epoch = data.steps_per_epoch(args.batch_size)

    def batch(i: int):
        # the engine's global batch of step i (its epoch's order and negatives, as the reference trainer's), in equal
        # contiguous slices: TorchRec's all-gathers take equal sizes
        epoch, at = divmod(i, per_epoch)
        targets = np.array_split(data.batch(epoch, 0, at, args.batch_size), world)[rank]
        ex = data.examples(targets, model_config, negative_seed(0, epoch))
        valid = ex.history >= 0
        cand = np.concatenate([ex.positive[:, None], ex.negatives], axis=1)
        values = np.concatenate([ex.history[valid]] + [cand[:, c] for c in range(C)])
        lengths = np.concatenate([valid.sum(axis=1)] + [np.ones(len(targets), dtype=np.int64)] * C)
        return KeyedJaggedTensor.from_lengths_sync(keys=features, values=torch.from_numpy(values.astype(np.int64)),
                                                   lengths=torch.from_numpy(lengths.astype(np.int32)))

    def step(i: int) -> None:
        logit = dmp(batch(i))
        label = torch.zeros_like(logit)
        label[:, 0] = 1.0
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logit, label, reduction="sum") / norm
        dense_opt.zero_grad()
        loss.backward()
        dense_opt.step()

    for i in range(WARMUP):
        step(i)
    dist.barrier()
    t = time.perf_counter()
    for i in range(WARMUP, WARMUP + args.steps):
        step(i)
    dist.barrier()
    if rank == 0:
        print(json.dumps({"rate": args.steps * args.batch_size / (time.perf_counter() - t)}), flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dataset")
    parser.add_argument("--batch-size", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--port", type=int, default=29511)
    args = parser.parse_args()
    try:
        import torchrec  # noqa: F401
    except Exception as e:  # ImportError, or fbgemm's own errors when its build does not match torch
        print(json.dumps({"skipped": f"torchrec is not importable ({type(e).__name__}: {e})"}))
        return
    import torch.multiprocessing as mp

    mp.spawn(_rank, args=(args.ranks, args), nprocs=args.ranks, join=True)


if __name__ == "__main__":
    sys.exit(main())
