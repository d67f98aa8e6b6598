"""A named cluster class as a run starts it (shardflow.cluster.run_cluster): its dashboard on loopback unless told
otherwise, and with the TLS files every connection encrypted and authenticated."""

from __future__ import annotations

import ipaddress

import psutil
import pytest

from shardflow.cluster import run_cluster
from support import pem_files

pytestmark = pytest.mark.cluster  # the tier: a named cluster class, as a run starts it


def listening(pid: int) -> set[tuple[str, int]]:
    procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    return {(c.laddr.ip, c.laddr.port) for p in procs for c in p.net_connections("inet")
            if c.status == psutil.CONN_LISTEN}


def test_a_local_cluster_class_binds_loopback_and_its_dashboard_too():
    import os

    before = listening(os.getpid())
    with run_cluster(None, "distributed.LocalCluster", {"n_workers": 1, "threads_per_worker": 1}, 1) as client:
        assert client.submit(sum, [1, 2]).result() == 3
        opened = listening(os.getpid()) - before
        dashboard = int(client.dashboard_link.split(":")[2].split("/")[0])
    assert dashboard in {port for _, port in opened}  # not vacuous: the dashboard is among them
    assert all(ipaddress.ip_address(ip).is_loopback for ip, _ in opened), sorted(opened)


def test_with_tls_files_the_cluster_speaks_tls_and_refuses_a_client_without_them(tmp_path):
    from distributed import Client

    files = pem_files(tmp_path)
    with run_cluster(None, "distributed.LocalCluster", {"n_workers": 1}, 1, **files) as client:
        assert client.scheduler.address.startswith("tls://")
        assert client.submit(sum, [1, 2]).result() == 3
        with pytest.raises((OSError, TimeoutError)):
            Client(client.scheduler.address.replace("tls://", "tcp://"), timeout=3)
