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
    assert config.step_shape() == StepShape(512, 32, "node", "adam")
    assert config.plan_options() == {"shape": StepShape(512, 32, "node", "adam"), "memory_slack": 0.3,
                                     "history": 50, "negatives": 256}
    train = config.training((2, 3))
    assert (train.batch_size, train.dedup, train.epochs, train.seed, train.eval_users, train.steps_per_epoch,
            train.window) == (512, "node", 3, 7, None, 9, (2, 3))
    optimizer = config.optimizer()
    assert (optimizer.row_lr, optimizer.dense, optimizer.dense_lr) == (0.1, "adagrad", 1e-3)
    assert "parsed_topology" not in config.model_dump()  # not a key of the flow's parameters
    adagrad = RetrainConfig(row_optimizer="adagrad")
    assert (adagrad.optimizer().rows, adagrad.optimizer().row_lr, adagrad.step_shape().row_optimizer) == \
        ("adagrad", 0.05, "adagrad")
    assert config.optimizer().row_lr == 0.1 and RetrainConfig().optimizer().row_lr == 2e-3


def test_the_keys_a_workload_decides_take_its_defaults_unless_given(tmp_path):
    """Left out (or none), encoder, loss and row_optimizer are the workload's: the sequence recipe for a sequence
    log, the DLRM's for a click log, whether the log is a source to import or a store already made; a value
    given stays, and one a click log cannot train is refused."""
    from storage.importers import import_dataset
    from support import REAL

    def chosen(config: RetrainConfig) -> tuple:
        return config.model.encoder, config.model.loss, config.train.row_optimizer

    sequences, clicks = ("self-attention", "gbce", "adam"), ("mean", "bce", "adagrad")
    assert chosen(RetrainConfig()) == sequences
    assert (RetrainConfig().train.epochs, RetrainConfig().train.patience) == (200, 10)
    assert chosen(RetrainConfig(encoder=None, loss=None, row_optimizer=None)) == sequences
    criteo = {"dataset": str(REAL["criteo"]), "dataset_format": "criteo"}
    assert chosen(RetrainConfig.build(criteo)) == clicks
    assert chosen(RetrainConfig.build({**criteo, "row_optimizer": "adam"})) == ("mean", "bce", "adam")
    assert chosen(RetrainConfig.build({"encoder": "mean", "loss": "bce"})) == ("mean", "bce", "adam")
    import_dataset("criteo", REAL["criteo"], tmp_path / "store", hash_rows=64)
    assert chosen(RetrainConfig.build({"dataset": str(tmp_path / "store")})) == clicks
    assert chosen(RetrainConfig.build({"model": {"dim": 8}, "train": {"epochs": 1}})) == sequences
    with pytest.raises(InputError, match=r"loss = 'gbce' for a criteo click log; accepted: bce"):
        RetrainConfig.build({**criteo, "loss": "gbce"})


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


def test_the_schema_a_deployment_and_the_ui_read_has_the_sections_and_names_the_flat_keys_too():
    import jsonschema

    schema = RetrainConfig.model_json_schema()
    assert list(schema["properties"]) == ["run_dir", *SECTIONS]  # the UI's form: the sections
    train = schema["$defs"]["TrainSection"]
    assert "epochs" in train["properties"] and train["additionalProperties"] is False
    jsonschema.validate({"epochs": 1, "nightly.top_k": 0, "train": {"seed": 3}}, schema)  # as the server checks
    with pytest.raises(jsonschema.ValidationError, match="'epoch' is not one of"):
        jsonschema.validate({"epoch": 1}, schema)
    assert RetrainConfig.build({"epochs": 1, "nightly.top_k": 0}).train.epochs == 1


@pytest.mark.parametrize(
    ("values", "refusal"),
    [
        ({"epochs": 2, "train.epochs": 3}, "train.epochs: given twice (also as epochs); accepted: one of them"),
        ({"train": {"epochs": 2}, "epochs": 3}, "epochs: given twice (also as train.epochs)"),
        ({"training.epochs": 3}, "training.epochs: no section 'training'; accepted: data, model, plan, train, "
         "nightly, cluster"),
        ({"train.epoch": 3}, "train.epoch = 3: Extra inputs are not permitted; did you mean epochs? (keys: "),
        ({"model": {"epochs": 3}}, "model.epochs = 3: Extra inputs are not permitted in section model; accepted: "
         "train.epochs, or epochs bare (keys: "),
        ({"trian": {"epochs": 3}}, "trian = {'epochs': 3}: Extra inputs are not permitted; did you mean train? "
         "(keys: "),
        ({"colour": 3}, "colour = 3: Extra inputs are not permitted (keys: "),
        ({"train": 3}, "train = 3: Input should be a valid dictionary"),
        ({"mlp": "64,32"}, "model.mlp = '64,32': Input should be a valid tuple; accepted: a list in brackets, e.g. "
         "mlp=[64, 32]"),
        ({"row_optimizer": "sgd"}, "train.row_optimizer = 'sgd': Input should be 'adagrad' or 'adam'"),
        ({1: 2}, "key 1 (int); accepted: a key's name, e.g. epochs"),  # YAML's `1: 2` was a TypeError traceback
        ({"train": {None: 2}}, "key train.None (NoneType); accepted: a key's name"),
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
    with pytest.raises(InputError, match="hash_rows = 0: .*accepted: an integer from 1 to 2,147,483,647 .* or 'exact'"):
        RetrainConfig.build({**base, "dataset_format": "criteo", "hash_rows": 0})
    with pytest.raises(InputError, match=r"bottom_mlp = \[8, 0\]: .*accepted: integers >= 1"):
        RetrainConfig.build({**base, "dataset_format": "criteo", "bottom_mlp": [8, 0]})
    assert not (root / "bad").exists()
    assert RetrainConfig.build({**base, "dataset_format": "criteo", "hash_rows": "exact"}).data.hash_rows == "exact"
    np.testing.assert_equal(RetrainConfig.build({**base, "dataset_format": "criteo"}).model.bottom_mlp, (64,))


@pytest.mark.parametrize("text, message", [
    ("epochs: 3\nepochs: 60000\n", r"cfg: line 2: key 'epochs' given twice \(also on line 1\); accepted: each key"),
    ("train:\n  epochs: 3\n  seed: 1\n  epochs: 4\n", r"line 4: key 'epochs' given twice \(also on line 2\)"),
    ("mlp: " + "[" * 5000 + "]" * 5000 + "\n", r"cfg: line 1: nested deeper than 16 levels"),
    ("a:\n" + "".join("  " * i + f"k{i}:\n" for i in range(1, 40)), r"nested deeper than 16 levels"),
    ("x: !!python/object/apply:os.system ['touch x']\n",
     r"cfg: line 1: not valid YAML \(could not determine a constructor for the tag .*os.system'\); accepted"),
])
def test_a_yaml_text_with_a_key_twice_deep_nesting_or_a_python_tag_is_one_line(text, message):
    from shardflow.safe_yaml import load_text

    with pytest.raises(InputError, match=message) as refused:
        load_text(text, "cfg")
    assert "\n" not in str(refused.value)


def test_yaml_reads_words_and_numbers_as_yaml_1_2_does_and_a_boolean_key_still_reads_yes():
    """YAML 1.1 reads `off`, `no`, `on` and `yes` as booleans: `full_ranking: off` reached the config as False and
    was refused. Only true and false are booleans here, as in YAML 1.2 (`--set KEY=VALUE` reads VALUE alike)."""
    from shardflow.safe_yaml import load_text

    text = "train:\n  full_ranking: off\n  early_answers: yes\nnightly: {train_window: all}\n"
    config = RetrainConfig.build(load_text(text, "cfg"))
    assert (config.train.full_ranking, config.train.early_answers) == ("off", True)
    assert [load_text(v, "cfg") for v in ("on", "no", "true", "False", "[true, off]")] == [
        "on", "no", True, False, [True, "off"]]
    # and a number in exponent form is a number, as in YAML 1.2 (1.1 needs a dot: `row_lr: 1e-3` was a string)
    assert [load_text(v, "cfg") for v in ("1e-3", "-2.5E+2", ".5e1", "3", "1e", "x1e3")] == [
        0.001, -250.0, 5.0, 3, "1e", "x1e3"]
    assert RetrainConfig.build({"early_answers": "off"}).train.early_answers is False


def test_yaml_reads_numbers_and_dates_as_yaml_1_2_does_not_as_octal_base_60_or_dates():
    """YAML 1.1 read `seed: 017` as 15 (octal), `epochs: 1:30` as 90 (base 60) and `run_dir: 2026-12-05` as a
    date, which was refused as not a path."""
    from shardflow.safe_yaml import load_text

    assert [load_text(v, "cfg") for v in ("017", "0o17", "0x1f", "-0", "1_000", "1_000.5", "+12", ".inf", "1.")] == [
        17, 15, 31, 0, 1000, 1000.5, 12, float("inf"), 1.0]
    assert [load_text(v, "cfg") for v in ("1:30", "1:30.5", "2026-12-05", "2026-12-05T10:00:00Z", "0b101", "1__0",
                                          "_1", ".")] == [
        "1:30", "1:30.5", "2026-12-05", "2026-12-05T10:00:00Z", "0b101", "1__0", "_1", "."]
    config = RetrainConfig.build(load_text("run_dir: 2026-12-05\ntrain:\n  seed: 017\n", "cfg"))
    assert (config.run_dir, config.train.seed) == ("2026-12-05", 17)
    with pytest.raises(InputError, match=r"^bad configuration: train.epochs = '1:30': Input should be a valid integer"):
        RetrainConfig.build(load_text("epochs: 1:30\n", "cfg"))


def test_a_value_nested_thousands_deep_is_shown_elided_in_one_line_not_recursed_into():
    deep: object = 1
    for _ in range(5000):
        deep = [deep]
    with pytest.raises(InputError, match=r"model.mlp.0 = \[\[\[\[...\]\]\]\]: Input should be a valid integer"):
        RetrainConfig.build({"mlp": deep})


@pytest.mark.parametrize("key, value, message", [
    ("epochs", 10**9, r"train.epochs = 1000000000: Input should be less than or equal to 1000"),
    ("patience", 10**6, r"train.patience = 1000000: Input should be less than or equal to 1000"),
    ("steps_per_epoch", 10**12, r"less than or equal to 2147483647"),
    ("eval_users", 10**12, r"less than or equal to 2147483647"),
    ("keep_versions", 10**6, r"nightly.keep_versions = 1000000: Input should be less than or equal to 10000"),
    ("max_restarts", 10**6, r"less than or equal to 100"),
    ("keep_checkpoints", 0, r"train.keep_checkpoints = 0: Input should be greater than or equal to 1"),
    ("restart_timeout_s", float("inf"), r"restart_timeout_s = inf: Input should be a finite number"),
    ("promotion_margin", float("nan"), r"promotion_margin = nan: Input should be a finite number"),
    ("replan_margin", float("nan"), r"replan_margin = nan: Input should be a finite number"),
    ("train_window", 10**12, r"1000000000000; accepted: 'new'"),
])
def test_every_count_and_size_has_a_bound(key, value, message):
    with pytest.raises(InputError, match=message):
        RetrainConfig.build({key: value})


@pytest.mark.parametrize("rows, message", [
    (10**9, r"hash_rows = 1,000,000,000: a table of 1,000,000,000 rows × 268 bytes \(dim 64 with its adagrad state "
            r"and access count\) is 268.0 GB, over half this machine's memory .*; accepted: at most [\d,]+ rows"),
    (10**12, r"data.hash_rows = 1000000000000: .*accepted: an integer from 1 to 2,147,483,647 \(row ids are int32\)"),
    (10**18, r"accepted: an integer from 1 to 2,147,483,647"),
])
def test_hash_rows_is_bounded_by_the_id_type_and_the_machines_memory(rows, message):
    with pytest.raises(InputError, match=message):
        RetrainConfig.build({"dataset_format": "criteo", "hash_rows": rows})
    assert RetrainConfig.build({"dataset_format": "criteo", "hash_rows": 1 << 20}).data.hash_rows == 1 << 20


def test_the_loss_is_a_sequence_models_and_reaches_it_a_click_log_keeps_bce():
    config = RetrainConfig.build({"loss": "sampled-softmax", "negatives": 1024})
    assert config.encoder_options()["loss"] == "sampled-softmax" and config.model.negatives == 1024
    with pytest.raises(InputError, match=r"loss = 'sampled-softmax' for a criteo click log; accepted: bce"):
        RetrainConfig.build({"loss": "sampled-softmax", "dataset_format": "criteo"})
    with pytest.raises(InputError, match=r"model.loss = 'hinge'"):
        RetrainConfig.build({"loss": "hinge"})
    gbce = RetrainConfig.build({"model": {"loss": "gbce", "gbce_t": 0.5}}).encoder_options()
    assert (gbce["loss"], gbce["gbce_t"]) == ("gbce", 0.5)
    with pytest.raises(InputError, match=r"loss = 'gbce' for a criteo click log; accepted: bce"):
        RetrainConfig.build({"loss": "gbce", "dataset_format": "criteo"})
