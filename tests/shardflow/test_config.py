"""The one run config: each stage takes its part of it as a value, the topology read once."""

from __future__ import annotations

from shardflow.config import RetrainConfig
from shardflow.planner.costmodel import StepShape
from shardflow.planner.topology import load_topology


def test_the_topology_is_read_once_and_equals_the_files():
    config = RetrainConfig(batch_size=512, dim=32, dedup="node", memory_slack=0.3)
    assert config.parsed_topology is config.parsed_topology  # read by the validators, kept
    assert config.parsed_topology == load_topology(config.topology)


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
