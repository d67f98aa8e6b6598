"""The CUDA path: the same steps on CUDA tensors give the CPU engine's parameters, and the reference trainer
what it gives on the CPU. Skipped without a GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shardflow.cluster import dask_client
from shardflow.data.clicks import load_training_data
from shardflow.model.configs import ClickConfig
from shardflow.training.config import TrainConfig
from shardflow.training.device import Device
from shardflow.training.engine import Engine
from shardflow.training.inprocess import InProcess
from shardflow.training.reference import ReferenceTrainer
from storage.dataset import Dataset
from storage.importers import import_dataset
from support import BATCH, MODEL, OPTIMIZER, REAL, TOPOLOGIES, planned, random_plan

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


def test_a_click_log_s_fused_tables_train_on_cuda_what_they_train_on_the_cpu(tmp_path):
    """MovieLens' nine tables, two of token sequences, fused into one (shardflow.training.fusion) on 2 devices."""
    import_dataset("recbole", REAL["recbole"], tmp_path / "ds", label="rating>=4")
    ds = Dataset.open(tmp_path / "ds")
    model = ClickConfig(dim=8, bottom=(8,), mlp=(8,), features=tuple(ds.info.table_names), numeric=ds.info.dense)
    data = load_training_data(ds, model.features)
    tables = planned(str(tmp_path / "ds"), "flexshard", 2, dim=model.dim, batch=BATCH).for_devices(2)
    out = {}
    for device in ("cpu", "cuda"):
        devs = [Device(d, TOPOLOGIES[2], tables, data, model, OPTIMIZER, batch_size=BATCH, dedup="device",
                       array_device=device) for d in range(2)]
        assert all(d.group is not None for d in devs)
        driver = InProcess(devs)
        for i in range(3):
            driver.step(0, i, i, 0)
        out[device] = [d.parameters() for d in devs]
    for cpu, gpu in zip(out["cpu"], out["cuda"], strict=True):
        for t in model.features:
            scale = np.abs(cpu[t]["weights"]).max(initial=1.0)
            assert np.abs(cpu[t]["weights"] - gpu[t]["weights"]).max(initial=0.0) <= 1e-5 * scale, t
