"""The CUDA path: the same steps on CUDA tensors give the CPU engine's parameters. Skipped without a GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from support import BATCH, MODEL, OPTIMIZER, TOPOLOGIES, random_plan
from shardflow.cluster import dask_client
from shardflow.training.config import TrainConfig
from shardflow.training.engine import Engine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible to PyTorch")


def test_cuda_engine_matches_the_cpu_engine(dataset, data):
    plan = random_plan(data, 2, seed=5)
    out = {}
    for device in ("cpu", "cuda"):
        with dask_client(workers=2, gpus=device == "cuda") as client:
            with Engine(client, dataset, plan, TOPOLOGIES[2], MODEL, OPTIMIZER, TrainConfig(BATCH, device=device)) as e:
                for i in range(3):
                    e.step(0, i)
                out[device] = e.parameters()
    for cpu, gpu in zip(out["cpu"], out["cuda"]):
        for t in ("item", "genre"):
            scale = np.abs(cpu[t]["weights"]).max(initial=1.0)
            assert np.abs(cpu[t]["weights"] - gpu[t]["weights"]).max(initial=0.0) <= 1e-5 * scale
