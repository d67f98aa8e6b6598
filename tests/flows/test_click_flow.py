"""The retraining flow on a click log: the Criteo sample imported night by night, a DLRM per version."""

from __future__ import annotations

import math
import re

import pytest
from test_retrain_flow import artifact_rows

from flows.retrain import retrain
from runs import SMALL, TOPOLOGY
from shardflow.config import RetrainConfig
from shardflow.errors import InputError
from shardflow.reporting.run_report import artifact_key
from storage.checkpoint import verify_export
from support import REAL, settled


@pytest.fixture(scope="module")
def nights(tmp_path_factory):
    """The sample's 200 rows as two nights' logs: 140 rows, then 60."""
    root = tmp_path_factory.mktemp("clicks")
    lines = REAL["criteo"].read_text().splitlines()
    (root / "logs").mkdir()
    (root / "topo.yaml").write_text(TOPOLOGY)
    return root, lines[0], lines[1:]


def config(root, client, **kw) -> RetrainConfig:
    values = dict(dataset=str(root / "logs"), dataset_format="criteo", hash_rows=256, run_dir=str(root / "run"),
                  topology=str(root / "topo.yaml"), scheduler_address=client.scheduler.address,
                  **{**SMALL, "batch_size": 16, "bottom_mlp": (8,), "eval_users": None})
    return RetrainConfig.build({**values, **kw})


def test_two_nights_of_a_click_log_make_two_dlrm_versions(prefect_api, client, nights):
    root, header, rows = nights
    (root / "logs" / "day1.csv").write_text("\n".join([header, *rows[:140]]) + "\n")
    settled(root / "logs" / "day1.csv")
    state = retrain(config(root, client), return_state=True)
    first = state.result()
    assert first["trained"] and first["promoted"] and first["window"] == [0, 0]
    assert first["hr_at_10"] is None and 0 <= first["auc"] <= 1 and math.isfinite(first["logloss"])
    assert first["eval_users"] == 14  # the last 10% of 140 rows
    assert first["bytes_per_step"] == pytest.approx(first["modeled_bytes_per_step"], rel=0.05)
    model = verify_export(first["model"])
    assert model.model["kind"] == "click" and len(model.tables) == 26
    tiers = artifact_rows(state.state_details.flow_run_id, artifact_key("plan-tables", root / "run"))
    assert [r["table"] for r in tiers] == [f"C{i}" for i in range(1, 27)]
    assert all(r["rows"] == 256 and r["table-wise"].startswith("device ") for r in tiers)
    assert len({r["table-wise"] for r in tiers}) == 2, "26 tables packed onto both devices"

    (root / "logs" / "day2.csv").write_text("\n".join([header, *rows[140:]]) + "\n")
    settled(root / "logs" / "day2.csv")
    second = retrain(config(root, client))
    assert second["trained"] and second["warm_start_from"] == 1 and second["window"] == [1, 1]
    assert second["eval_users"] == 6 and second["previous_logloss"] is not None and second["previous_hr_at_10"] is None
    assert second["promoted"] == (second["auc"] >= second["previous_auc"] - 0.002)
    assert second["parts_added"] == ["day2.csv"]
    assert not [w for w in (*first["warnings"], *second["warnings"]) if "hashed tables" in w]  # 256 rows: fit


def test_two_nights_of_movielens_as_a_click_log_with_feature_files_make_two_dlrm_versions(prefect_api, client,
                                                                                          tmp_path):
    """RecBole's atomic files: the ratings split by time into two nights' parts, the .user and .item files beside
    them (joined, never parts), a rating of 4 or more a click."""
    lines = REAL["recbole"].read_text().splitlines()
    header, rows = lines[0], sorted(lines[1:], key=lambda line: float(line.split("\t")[3]))
    logs = tmp_path / "logs"
    logs.mkdir()
    for suffix in (".user", ".item"):
        (logs / f"ml-100k{suffix}").write_bytes(REAL["recbole"].with_suffix(suffix).read_bytes())
    (tmp_path / "topo.yaml").write_text(TOPOLOGY)
    values = dict(dataset=str(logs), dataset_format="recbole", click_label="rating>=4", run_dir=str(tmp_path / "run"),
                  topology=str(tmp_path / "topo.yaml"), scheduler_address=client.scheduler.address,
                  **{**SMALL, "batch_size": 1024, "epochs": 1, "eval_users": None})

    def arrives(name: str, part: list[str]) -> None:
        (logs / name).write_text("\n".join([header, *part]) + "\n")
        settled(logs / name)

    arrives("day1.inter", rows[:90_000])
    first = retrain(RetrainConfig.build(values))
    assert first["trained"] and first["promoted"] and first["parts_added"] == ["day1.inter"]
    assert first["eval_users"] == 9_000 and first["hr_at_10"] is None and 0.5 < first["auc"] <= 1
    model = verify_export(first["model"])
    assert model.model["kind"] == "click"
    assert sorted(model.tables) == sorted(["user", "item", "age", "gender", "occupation", "zip_code",
                                              "release_year", "movie_title", "class"])  # genres, title words too
    arrives("day2.inter", rows[90_000:])
    second = retrain(RetrainConfig.build(values))
    assert second["trained"] and second["warm_start_from"] == 1 and second["parts_added"] == ["day2.inter"]
    assert second["eval_users"] == 1_000 and 0.5 < second["auc"] <= 1
    with pytest.raises(InputError, match=r"click_label = 'rating>=4' with dataset_format 'criteo'; accepted: "
                                         r"click_label only with dataset_format 'recbole'"):
        RetrainConfig.build({**values, "dataset_format": "criteo"})


def test_hashed_tables_that_the_log_mostly_leaves_unread_are_a_warning_in_the_summary(prefect_api, client, tmp_path):
    """The sample's 180 training rows read a few thousand of 26 tables × 4,096 hashed rows; every checkpoint and
    the export would store them all (at the default 2^20 rows: 27M rows, 7.1 GB a copy at dim 64)."""
    (tmp_path / "topo.yaml").write_text(TOPOLOGY)
    values = dict(dataset=str(REAL["criteo"]), dataset_format="criteo", hash_rows=4096, run_dir=str(tmp_path / "run"),
                  topology=str(tmp_path / "topo.yaml"), scheduler_address=client.scheduler.address,
                  **{**SMALL, "batch_size": 16, "bottom_mlp": (8,), "eval_users": None, "epochs": 1})
    summary = retrain(RetrainConfig.build(values))
    [warning] = [w for w in summary["warnings"] if "hashed tables" in w]
    assert re.match(r"this version's examples read [\d,]+ of the 106,496 rows of its 26 hashed tables \(\d\.\d%; "
                    r"hash_rows 4,096\): every checkpoint and the export store them all; a run_dir imported with a "
                    r"smaller hash_rows, or exact \(a row per value\), stores what the log reads$", warning), warning
