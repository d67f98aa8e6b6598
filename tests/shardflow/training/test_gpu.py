"""The CUDA path: the same steps on CUDA tensors give the CPU engine's parameters, and the reference trainer
what it gives on the CPU. Skipped without a GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shardflow.cluster import dask_client
from shardflow.training.config import TrainConfig
from shardflow.training.engine import Engine
from shardflow.training.reference import ReferenceTrainer
from support import BATCH, MODEL, OPTIMIZER, TOPOLOGIES, random_plan

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible to PyTorch")


@pytest.mark.parametrize("transport", ["collective", "actor"])
def test_cuda_engine_matches_the_cpu_engine(dataset, data, transport):
    plan = random_plan(data, 2, seed=5)
    out = {}
    for device in ("cpu", "cuda"):
        train = TrainConfig(BATCH, device=device, transport=transport)
        with dask_client(workers=2) as client:
            with Engine(client, dataset, plan, TOPOLOGIES[2], MODEL, OPTIMIZER, train) as e:
                for i in range(3):
                    e.step(0, i)
                out[device] = e.parameters()
    for cpu, gpu in zip(out["cpu"], out["cuda"], strict=True):
        for t in ("item", "genre"):
            scale = np.abs(cpu[t]["weights"]).max(initial=1.0)
            assert np.abs(cpu[t]["weights"] - gpu[t]["weights"]).max(initial=0.0) <= 1e-5 * scale


def test_the_reference_trainer_on_cuda_learns_what_it_learns_on_the_cpu(data):
    out = {}
    for device in ("cpu", "cuda"):
        ref = ReferenceTrainer(data, MODEL, OPTIMIZER, BATCH, seed=0, device=torch.device(device))
        for i in range(3):
            ref.step(0, i)
        out[device] = ref
    for t, cpu in out["cpu"].weights.items():
        scale = np.abs(cpu).max(initial=1.0)
        assert np.abs(cpu - out["cuda"].weights[t]).max(initial=0.0) <= 1e-5 * scale
        assert np.array_equal(out["cpu"].state[t] > 0, out["cuda"].state[t] > 0), "the same rows were updated"
    for k, cpu in out["cpu"].dense.items():
        assert np.abs(cpu - out["cuda"].dense[k]).max(initial=0.0) <= 1e-5 * np.abs(cpu).max(initial=1.0)
