"""The one run config: each stage takes its part of it as a value, the topology read once."""

from __future__ import annotations

import re

import numpy as np
import pytest

from shardflow.config import RetrainConfig
from shardflow.config_sections import SECTION_OF, SECTIONS, overridden
from shardflow.errors import InputError
from shardflow.planner.costmodel import StepShape
from shardflow.planner.topology import load_topology

TOPOLOGY = "intra_node_gbytes_per_s: 100\nnodes:\n  - {name: a, devices: 2, uplink_gbytes_per_s: 10}\n"


def test_the_topology_is_read_once_and_equals_the_files():
    config = RetrainConfig(batch_size=512, dim=32, dedup="node", memory_slack=0.3)
    assert config.parsed_topology is config.parsed_topology  # read by the validators, kept
    assert config.parsed_topology == load_topology(config.plan.topology)


def test_each_stage_gets_the_keys_it_reads():
    config = RetrainConfig(batch_size=512, dim=32, dedup="node", memory_slack=0.3, epochs=3, seed=7, row_lr=0.1,
                           dense_optimizer="adagrad", eval_users=None, steps_per_epoch=9)
    assert config.step_shape() == StepShape(512, 32, "node")
    assert config.plan_options() == {"shape": StepShape(512, 32, "node"), "memory_slack": 0.3, "history": 20,
                                     "negatives": 4}
    train = config.training((2, 3))
    assert (train.batch_size, train.dedup, train.epochs, train.seed, train.eval_users, train.steps_per_epoch,
            train.window) == (512, "node", 3, 7, None, 9, (2, 3))
    optimizer = config.optimizer()
    assert (optimizer.row_lr, optimizer.dense, optimizer.dense_lr) == (0.1, "adagrad", 1e-3)
    assert "parsed_topology" not in config.model_dump()  # not a key of the flow's parameters
    adam = RetrainConfig(row_optimizer="adam")
    assert (adam.optimizer().rows, adam.optimizer().row_lr, adam.step_shape().row_optimizer) == ("adam", 2e-3, "adam")


def test_a_key_is_named_bare_with_its_section_or_in_its_section_alike():
    bare = RetrainConfig.build({"epochs": 3, "dim": 32, "strategy": "row-wise-mod", "keep_versions": 5})
    dotted = RetrainConfig.build({"train.epochs": 3, "model.dim": 32, "plan.strategy": "row-wise-mod",
                                  "nightly.keep_versions": 5})
    nested = RetrainConfig.build({"train": {"epochs": 3}, "model": {"dim": 32}, "plan": {"strategy": "row-wise-mod"},
                                  "nightly": {"keep_versions": 5}})
    assert bare == dotted == nested
    assert (bare.train.epochs, bare.model.dim, bare.plan.strategy, bare.nightly.keep_versions) == (3, 32,
                                                                                                   "row-wise-mod", 5)
    assert RetrainConfig.build(bare.flat()) == bare  # what records store builds the same config
    assert set(bare.flat()) == {*SECTION_OF, "run_dir"}


def test_the_schema_a_deployment_and_the_ui_read_has_the_sections():
    schema = RetrainConfig.model_json_schema()
    assert list(schema["properties"]) == ["run_dir", *SECTIONS]
    assert schema["additionalProperties"] is False
    train = schema["$defs"]["TrainSection"]
    assert "epochs" in train["properties"] and train["additionalProperties"] is False


@pytest.mark.parametrize(
    ("values", "refusal"),
    [
        ({"epochs": 2, "train.epochs": 3}, "train.epochs: given twice (also as epochs); accepted: one of them"),
        ({"train": {"epochs": 2}, "epochs": 3}, "epochs: given twice (also as train.epochs)"),
        ({"training.epochs": 3}, "training.epochs: no section 'training'; accepted: data, model, plan, train, "
         "nightly, cluster"),
        ({"train.epoch": 3}, "train.epoch = 3: Extra inputs are not permitted"),
        ({"model": {"epochs": 3}}, "model.epochs = 3: Extra inputs are not permitted"),
        ({"train": 3}, "train = 3: Input should be a valid dictionary"),
        ({"row_optimizer": "sgd"}, "train.row_optimizer = 'sgd': Input should be 'adagrad' or 'adam'"),
    ],
)
def test_a_key_misplaced_or_given_twice_is_refused_by_name(values, refusal):
    with pytest.raises(InputError, match=re.escape(refusal)):
        RetrainConfig.build(values)


def test_set_overrides_a_config_file_key_however_either_spells_it():
    file = {"run_dir": "runs/x", "train": {"epochs": 2, "seed": 4}, "dim": 16}
    values = overridden(file, {"epochs": 5, "model.dim": 8, "plan.strategy": "table-wise"})
    config = RetrainConfig.build(values)
    assert (config.train.epochs, config.train.seed, config.model.dim, config.plan.strategy) == (5, 4, 8, "table-wise")
    assert file == {"run_dir": "runs/x", "train": {"epochs": 2, "seed": 4}, "dim": 16}  # the file's values untouched


def test_bad_configuration_is_refused_before_anything_starts(tmp_path):
    with pytest.raises(InputError, match=r"strategy = 'fast'.*epochs = 0.*batch_size = -1"):
        RetrainConfig.build({"run_dir": str(tmp_path / "r"), "epochs": 0, "batch_size": -1, "strategy": "fast"})
    with pytest.raises(InputError, match="no such file; accepted: a topology YAML file"):
        RetrainConfig.build({"topology": str(tmp_path / "missing.yaml")})
    assert not (tmp_path / "r").exists()


def test_click_settings_are_checked_before_any_work(tmp_path):
    root = tmp_path
    (root / "logs").mkdir()
    (root / "topo.yaml").write_text(TOPOLOGY)
    base = dict(dataset=str(root / "logs"), run_dir=str(root / "bad"), topology=str(root / "topo.yaml"))
    with pytest.raises(InputError, match="hash_rows = 64 with dataset_format 'sasrec'; accepted: hash_rows only with"):
        RetrainConfig.build({**base, "hash_rows": 64})
    with pytest.raises(InputError, match="hash_rows = 0: .*accepted: an integer >= 1 or 'exact'"):
        RetrainConfig.build({**base, "dataset_format": "criteo", "hash_rows": 0})
    with pytest.raises(InputError, match=r"bottom_mlp = \[8, 0\]: .*accepted: integers >= 1"):
        RetrainConfig.build({**base, "dataset_format": "criteo", "bottom_mlp": [8, 0]})
    assert not (root / "bad").exists()
    assert RetrainConfig.build({**base, "dataset_format": "criteo", "hash_rows": "exact"}).data.hash_rows == "exact"
    np.testing.assert_equal(RetrainConfig.build({**base, "dataset_format": "criteo"}).model.bottom_mlp, (64,))
