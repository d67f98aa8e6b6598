"""The CLI's flags take their defaults from the one config: `shardflow plan`, `train` and `run` agree."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from cli.arguments import command_parsers
from cli.main import build_parser
from shardflow.config_sections import SECTION_OF, SECTIONS

BIN = Path(sys.executable).parent
SHARED = {
    "plan": ["memory_slack", "batch_size", "dim", "dedup", "history", "negatives"],
    "train": ["epochs", "device", "seed", "eval_users", "early_answers", "transport", "loss"],
}


@pytest.mark.parametrize("command", sorted(SHARED))
def test_every_flag_a_config_key_names_defaults_to_the_config(command, tmp_path):
    positional = {"plan": [str(tmp_path / "profile"), "--topology", "t.yaml", "--strategy", "flexshard"],
                  "train": [str(tmp_path / "ds"), "--plan", str(tmp_path / "plan")]}[command]
    args = vars(build_parser().parse_args([command, *positional]))
    for key in SHARED[command]:
        assert args[key] == SECTIONS[SECTION_OF[key]].model_fields[key].default, key


def test_plan_and_run_plan_under_the_same_default_budget(tmp_path):
    args = build_parser().parse_args(["plan", str(tmp_path), "--topology", "t.yaml", "--strategy", "flexshard"])
    assert args.memory_slack == SECTIONS["plan"].model_fields["memory_slack"].default == 0.1


def test_a_choice_outside_the_configs_is_refused_by_the_flag(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["plan", "p", "--topology", "t.yaml", "--strategy", "random"])
    assert "invalid choice: 'random'" in capsys.readouterr().err



@pytest.mark.parametrize("command, flag, value, refusal", [
    ("plan", "--history", "100000000", "Input should be less than or equal to 4096"),  # was a traceback
    ("plan", "--negatives", "1000000000", "Input should be less than or equal to 4096"),  # was a traceback
    ("plan", "--memory-slack", "1e9", "Input should be less than or equal to 100"),  # was a traceback
    ("plan", "--memory-slack", "nan", "Input should be a finite number"),
    ("plan", "--dim", "100000000", "Input should be less than or equal to 4096"),  # was planned
    ("plan", "--batch-size", "999999999999", "Input should be less than or equal to 2147483647"),  # was planned
    ("train", "--dropout", "2", "Input should be less than 1"),
    ("train", "--item-dropout", "1", "Input should be less than 1"),
    ("train", "--patience", "5000", "Input should be less than or equal to 1000"),  # was taken
    ("train", "--min-epochs", "0", "Input should be greater than or equal to 1"),
    ("evaluate", "--seed", "99999999999999999999999", "Input should be less than or equal to 9223372036854775807"),
])
def test_a_flag_holds_its_config_keys_bounds_and_is_refused_in_one_line(command, flag, value, refusal, tmp_path):
    """The flags take the run config's bounds, not only its type; argparse's refusal is one line, as the others."""
    positional = {"plan": [str(tmp_path / "profile"), "--topology", "t.yaml", "--strategy", "flexshard"],
                  "train": [str(tmp_path / "ds"), "--plan", str(tmp_path / "plan")],
                  "evaluate": [str(tmp_path / "model"), str(tmp_path / "ds")]}[command]
    done = subprocess.run([str(BIN / "shardflow"), command, *positional, flag, value], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == "", done
    assert done.stderr == f"shardflow {command}: error: argument {flag}: '{value}': {refusal}; see 'shardflow " \
                          f"{command} --help'\n"
    assert not list(tmp_path.iterdir())


def test_help_shows_real_defaults_and_never_python_s_none():
    commands = command_parsers(build_parser())
    helps = {name: " ".join(sub.format_help().split()) for name, sub in commands.items()}
    assert not [name for name, text in helps.items() if "default: None" in text]
    assert "--epochs EPOCHS epochs to train (with patience: at most) (default: 200)" in helps["train"]
