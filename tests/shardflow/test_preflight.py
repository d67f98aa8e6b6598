"""Pre-flight checks that need no store: what a local cluster would refuse once the run had written."""

from __future__ import annotations

import psutil
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


def test_a_sequence_step_no_local_worker_can_hold_is_refused_before_the_import(tmp_path):
    """The bundled log's default model at history 4,096: a batch whose step takes 70% of this machine on each of 2
    local workers (each may use half) is refused; at 20% it passes, and a scheduler's workers are their own."""
    total = psutil.virtual_memory().total
    per_example = config(tmp_path, history=4096, batch_size=2).step_bytes(2)  # one example a device

    def batch(share: float) -> int:
        return 2 * max(1, int(share * total / per_example))

    with pytest.raises(InputError, match=r"^a training step needs about [\d.,]+ GiB on each of the 2 devices "
                                         r"\(batch_size \d+ over them × \(history 4096 \+ 1 \+ negatives 256\) rows "
                                         r"× dim 64, .*but a local cluster's worker may use [\d.,]+ GiB .*; accepted: "
                                         r"smaller batch_size, history, negatives or dim, or a cluster of larger "
                                         r"workers"):
        check_local_cluster(config(tmp_path, history=4096, batch_size=batch(0.7)))
    check_local_cluster(config(tmp_path, history=4096, batch_size=batch(0.2)))
    check_local_cluster(config(tmp_path, history=4096, batch_size=batch(0.7), scheduler_address="tcp://127.0.0.1:8786"))
