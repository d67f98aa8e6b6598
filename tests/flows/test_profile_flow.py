"""The profiling flow under a real Prefect test harness, on the session's LocalCluster."""

import asyncio

import pytest
from prefect.client.orchestration import get_client

from support import REAL
from flows.profile_counts import profile_flow
from shardflow.errors import InputError
from storage.importers import import_dataset
from storage.profile import Profile


async def latest_artifacts():
    async with get_client() as c:
        return await c.read_latest_artifacts()


def test_profile_flow_writes_the_profile_and_a_table_artifact(prefect_api, client, tmp_path):
    import_dataset("sasrec", REAL["sasrec"], tmp_path / "ds")
    stats = profile_flow(str(tmp_path / "ds"), str(tmp_path / "p"), scheduler_address=client.scheduler.address)
    assert stats["item"].accesses == 287107
    assert Profile.open(tmp_path / "p").counts("item").sum() == 287107

    table = next(a for a in asyncio.run(latest_artifacts()) if a.key == "profile")
    assert table.type == "table" and "287107" in str(table.data)


def test_profile_flow_refuses_bad_input_and_fails(prefect_api, client, tmp_path):
    state = profile_flow(
        str(tmp_path / "missing"), str(tmp_path / "p"), scheduler_address=client.scheduler.address, return_state=True
    )
    assert state.is_failed()
    with pytest.raises(InputError, match="no such directory"):
        state.result()
    assert not (tmp_path / "p").exists()
