"""Pre-flight checks that need no store: where the run's devices compute."""

from __future__ import annotations

import pytest
import torch

from shardflow.config import RetrainConfig
from shardflow.errors import InputError
from shardflow.preflight import check_device

TOPOLOGY = "intra_node_gbytes_per_s: 100\nnodes:\n  - {name: a, devices: 2, uplink_gbytes_per_s: 10}\n"


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is visible here: a local cluster's workers may use it")
def test_cuda_is_refused_where_the_local_workers_would_have_no_gpu_and_left_to_remote_workers(tmp_path):
    (tmp_path / "topo.yaml").write_text(TOPOLOGY)

    def config(**keys) -> RetrainConfig:
        return RetrainConfig.build({"topology": str(tmp_path / "topo.yaml"), "run_dir": str(tmp_path / "run"),
                                    **keys})

    for local in ({}, {"cluster_class": "distributed.LocalCluster"}):
        with pytest.raises(InputError, match=r"^device 'cuda': no CUDA device is visible to PyTorch; accepted here: "
                                             r"cpu$"):
            check_device(config(device="cuda", **local))
        check_device(config(device="cpu", **local))
    check_device(config(device="cuda", scheduler_address="tcp://127.0.0.1:8786"))  # its workers judge their own
