"""Session-wide fixtures: one LocalCluster and one Prefect test harness for the whole run."""

from __future__ import annotations

import pytest
from distributed import Client, LocalCluster


@pytest.fixture(scope="session")
def client():
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster:
        with Client(cluster) as c:
            yield c


@pytest.fixture(scope="session")
def prefect_api():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness():
        yield
