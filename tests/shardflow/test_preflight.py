"""Pre-flight checks that need no store: what a local cluster would refuse once the run had written."""

from __future__ import annotations

import pytest
import torch

from shardflow.cluster_options import local_worker_limit
from shardflow.config import RetrainConfig
from shardflow.errors import InputError
from shardflow.preflight import check_local_cluster


def topology(tmp_path, devices: int) -> str:
    path = tmp_path / f"topo-{devices}.yaml"
    path.write_text(f"intra_node_gbytes_per_s: 100\nnodes:\n  - {{name: a, devices: {devices}, "
                    "uplink_gbytes_per_s: 10}\n")
    return str(path)


def config(tmp_path, devices: int = 2, **keys) -> RetrainConfig:
    return RetrainConfig.build({"topology": topology(tmp_path, devices), "run_dir": str(tmp_path / "run"), **keys})


def test_a_topology_larger_than_a_local_cluster_may_be_is_refused_unless_the_cluster_is_elsewhere(tmp_path):
    most = local_worker_limit()
    check_local_cluster(config(tmp_path, most))
    with pytest.raises(InputError, match=rf"^topology .*topo-{most + 1}\.yaml: workers = {most + 1}: a local cluster "
                                         rf"of {most + 1} processes \(one per device\) on \d+ cores; accepted: at most "
                                         rf"{most}, or a Dask cluster of its own"):
        check_local_cluster(config(tmp_path, most + 1))
    # a local class without n_workers was scaled to the devices unchecked
    with pytest.raises(InputError, match=rf"^topology .*: workers = {most + 1}: a local cluster"):
        check_local_cluster(config(tmp_path, most + 1, cluster_class="distributed.LocalCluster"))
    check_local_cluster(config(tmp_path, most + 1, scheduler_address="tcp://127.0.0.1:8786"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is visible here: a local cluster's workers may use it")
def test_cuda_is_refused_where_the_local_workers_would_have_no_gpu_and_left_to_remote_workers(tmp_path):
    for local in ({}, {"cluster_class": "distributed.LocalCluster"}):
        with pytest.raises(InputError, match=r"^device 'cuda': no CUDA device is visible to PyTorch; accepted here: "
                                             r"cpu$"):
            check_local_cluster(config(tmp_path, device="cuda", **local))
        check_local_cluster(config(tmp_path, device="cpu", **local))
    check_local_cluster(config(tmp_path, device="cuda", scheduler_address="tcp://127.0.0.1:8786"))  # its own workers
