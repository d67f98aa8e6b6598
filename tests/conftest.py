"""Session-wide fixtures: one LocalCluster and one Prefect test harness for the whole run."""

from __future__ import annotations

import pytest

from shardflow.cluster import dask_client

WORKERS = 4  # the training tests place up to four devices, one per worker


@pytest.fixture(scope="session")
def client():
    with dask_client(workers=WORKERS) as c:
        yield c


@pytest.fixture(scope="session")
def prefect_api():
    from prefect.testing.utilities import prefect_test_harness

    from prefect.settings import PREFECT_API_URL

    # Prefect's harness gives its server 30 s; under load (every core busy) it needs more, as the embedded
    # API does (flows/api.py): the same bound.
    from flows.api import STARTUP_TIMEOUT_S

    with prefect_test_harness(server_startup_timeout=STARTUP_TIMEOUT_S):
        yield PREFECT_API_URL.value()
