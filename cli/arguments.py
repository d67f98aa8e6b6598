"""The `shardflow` command line: every subcommand's arguments, and the values they take."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import NoReturn

from cli.commands import (
    run_evaluate,
    run_import,
    run_plan,
    run_profile,
    run_promote,
    run_recommend,
    run_run,
    run_synth,
    run_train,
    show_dataset,
    show_evaluate,
    show_plan,
    show_profile,
    show_promote,
    show_recommend,
    show_run,
    show_train,
)
from shardflow.errors import InputError

DESCRIPTION = "The `shardflow` command: one subcommand per stage."


def _key_value_rows(text: str) -> tuple[str, int]:
    name, sep, rows = text.partition("=")
    if not sep or not (rows.isdigit() or rows == "exact"):
        raise argparse.ArgumentTypeError(f"{text!r}; accepted: NAME=ROWS or NAME=exact, e.g. C1=100000")
    return name, rows if rows == "exact" else int(rows)


def _hash_rows(text: str) -> int | str:
    if not (text.isdigit() or text == "exact"):
        raise argparse.ArgumentTypeError(f"{text!r}; accepted: ROWS (an integer) or exact")
    return text if text == "exact" else int(text)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 7 * 86400:
        raise argparse.ArgumentTypeError(f"{text!r}; accepted: seconds from 0 to 604800 (a week)")
    return value


def _set_value(text: str) -> tuple[str, object]:
    from shardflow.safe_yaml import load_text

    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r}; accepted: KEY=VALUE, e.g. epochs=3")
    try:
        return key, load_text(value, f"--set {key}")
    except InputError as e:
        raise argparse.ArgumentTypeError(str(e)) from None



def _config_flag(p: argparse.ArgumentParser, key: str, **given) -> None:
    """--KEY for the config key `key`, its type, choices, default and help taken from RetrainConfig (the one
    source of every default: `shardflow plan`, `train` and `run` agree); `given` adds or replaces any of them."""
    from types import NoneType, UnionType
    from typing import Literal, Union, get_args, get_origin

    from shardflow.config_sections import SECTION_OF, SECTIONS

    field = SECTIONS[SECTION_OF[key]].model_fields[key]
    kind, default = field.annotation, field.default
    if get_origin(kind) in (Union, UnionType) and NoneType in get_args(kind):  # `X | None`: the flag takes X
        kind = next(a for a in get_args(kind) if a is not NoneType)
    spec: dict = {"default": default, "help": (field.description or key.replace("_", " ")).replace("%", "%%")}
    if kind is bool:
        spec["action"] = "store_true"
    elif get_origin(kind) is Literal:
        spec["choices"] = list(get_args(kind))
    else:
        spec["type"] = _bounded(kind, field.metadata)
    spec.update(given)
    if spec.get("required"):
        spec.pop("default")
    elif spec["default"] is not None:  # a None default: its help says what an absent flag means
        spec["help"] += f" (default: {spec['default']})"
    p.add_argument("--" + key.replace("_", "-"), **spec)


def _bounded(kind: type, bounds: list) -> Callable[[str], object]:
    """A flag's parser that holds its value to the config key's type and bounds (`shardflow plan --history 10^8`
    was read as given and ended in a traceback where `shardflow run` refuses it); the refusal is pydantic's
    words, as the run's config gives them."""
    from typing import Annotated

    from pydantic import TypeAdapter, ValidationError

    adapter: TypeAdapter = TypeAdapter(Annotated[kind, *bounds])

    def parse(text: str) -> object:
        try:
            return adapter.validate_python(text)
        except ValidationError as e:
            raise argparse.ArgumentTypeError(f"{text!r}: {e.errors()[0]['msg']}") from None

    return parse


def _import_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--format", required=True, choices=["sasrec", "s3rec", "recbole", "criteo"])
    p.add_argument("src", help="a source file, a .gz file, or a directory of part files (read in name order)")
    p.add_argument("dest", help="dataset store to create (or to append to, with --append)")
    p.add_argument("--overwrite", action="store_true", help="replace a store already at DEST")
    p.add_argument("--append", action="store_true", help="add the parts of SRC that DEST does not hold yet")
    p.add_argument("--replace-from", metavar="PART",
                   help="read PART (a part DEST holds that changed since) and every later part again, as a new version")
    p.add_argument("--settle-s", type=_seconds, default=0.0, metavar="SECONDS",
                   help="read only parts not modified for this long (default 0; parts must still end with a "
                   "newline, or have a NAME.done marker where the directory uses them)")
    p.add_argument("--workers", type=int, help="scan several parts in parallel on a local cluster of this size")
    p.add_argument("--scheduler", help="address of an existing Dask scheduler to scan parts on")
    p.add_argument("--table-rows", type=_key_value_rows, action="append", metavar="NAME=ROWS",
                   help="criteo: rows of one hashed categorical table, or exact: a row per value (repeatable)")
    p.add_argument("--hash-rows", type=_hash_rows,
                   help="criteo: rows of every other categorical table (default 2^20), or exact")
    p.add_argument("--label", metavar="FIELD>=NUMBER",
                   help="recbole: a click log, an interaction a click when FIELD is at least NUMBER ('rating>=4'); "
                   "joined with the .user and .item feature files beside it")


def _synth_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("dest", help="dataset store to create")
    p.add_argument("--tables", nargs="+", required=True, metavar="NAME:ROWS[:ALPHA]",
                   help="the first is the item sequence table, the rest feature columns")
    p.add_argument("--interactions", type=int, required=True, help="events (ids per table)")
    p.add_argument("--seed", type=int, required=True, help="every draw's seed: the same seed, the same store")
    p.add_argument("--mean-length", type=float, default=20.0, help="mean sequence length per user (default: 20)")
    p.add_argument("--repeat", type=float, default=0.0,
                   help="share of events that repeat one of the user's last --repeat-window items (session data; "
                   "default: 0)")
    p.add_argument("--repeat-window", type=int, default=5, help="the last items a repeat draws from (default: 5)")
    p.add_argument("--overwrite", action="store_true", help="replace a store already at DEST")


def _profile_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("dataset", help="dataset store")
    p.add_argument("--out", help="profile store to create (default: DATASET.profile)")
    p.add_argument("--workers", type=int, help="local cluster size (default: one per core)")
    p.add_argument("--scheduler", help="address of an existing Dask scheduler instead of a local cluster")
    p.add_argument("--overwrite", action="store_true", help="replace a profile already at --out")


def _plan_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("profile", help="profile store")
    p.add_argument("--topology", required=True, help="topology YAML file")
    _config_flag(p, "strategy", required=True)
    _config_flag(p, "memory_slack")
    _config_flag(p, "batch_size", help="global batch (examples per step)")
    _config_flag(p, "dim", help="embedding dimension")
    _config_flag(p, "dedup", help="de-duplication scope: none, device (a trainer fetches each row once), node "
                 "(a node does)")
    _config_flag(p, "history")
    _config_flag(p, "negatives")
    _config_flag(p, "row_optimizer", help="the rows' optimizer, whose state a row's memory counts (none: adam for a "
                 "sequence log, adagrad for a click log)")
    p.add_argument("--out", help="plan store to create (default: plan-STRATEGY beside the profile)")
    p.add_argument("--overwrite", action="store_true", help="replace a plan already at --out")


def _train_args(p: argparse.ArgumentParser) -> None:
    from pydantic import Field

    from shardflow.config_sections import MAX_EPOCHS

    p.add_argument("dataset", help="dataset store")
    p.add_argument("--plan", required=True, help="plan store of this dataset")
    _config_flag(p, "epochs")
    _config_flag(p, "patience", type=_bounded(int, [Field(ge=0, le=MAX_EPOCHS)]),  # 0: the key's none
                 help="stop after this many epochs without a better validation score and keep the best epoch; 0: "
                 "no validation split, every epoch (the run's key `patience` has the details)")
    _config_flag(p, "min_epochs")
    p.add_argument("--max-steps", type=int, help="stop after this many steps in all")
    p.add_argument("--batch-size", type=int, help="global batch (default: the plan's)")
    p.add_argument("--dedup", choices=["none", "device", "node"], help="de-duplication scope (default: the plan's)")
    _config_flag(p, "row_optimizer", default=None, help="the rows' optimizer (default: the plan's, whose memory "
                 "budget counts its state)")
    _config_flag(p, "row_lr", type=float)
    _config_flag(p, "early_answers", help="answer the next step's row requests while waiting, patch them when it "
                 "begins")
    _config_flag(p, "transport", help="how a step's messages travel between devices: the devices' gloo group "
                 "(collective), or Dask actor calls (actor); auto: collective unless --early-answers")
    _config_flag(p, "device", help="where each device computes: the CPU, or CUDA device d on worker d (resource "
                 "GPU=1)")
    _config_flag(p, "seed")
    for key in ("encoder", "attention_blocks", "attention_heads", "dropout", "item_dropout", "loss", "gbce_t"):
        _config_flag(p, key)
    _config_flag(p, "eval_users", type=int, help="held-out users evaluated (0: all)")
    _config_flag(p, "full_ranking", help="with --patience, sequences: rank the validation split among the whole "
                 "catalog after every epoch and choose epochs on it (off: on the sampled protocol)")
    p.add_argument("--estimate", action="store_true", help="estimation mode: every table on one parameter server")
    p.add_argument("--server-memory", type=int, help="estimation: the server's bytes (default: the topology's)")
    p.add_argument("--scheduler", help="address of an existing Dask scheduler (one worker per device)")


def _evaluate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="an exported model (RUN_DIR/versions/NNNN/model)")
    p.add_argument("dataset", help="the dataset store it was trained on (RUN_DIR/dataset)")
    p.add_argument("--users", type=int, help="held-out users evaluated, a seeded sample (default: all)")
    _config_flag(p, "seed")
    _config_flag(p, "full_ranking")
    p.add_argument("--workers", type=int, help="rank the catalog on a local cluster of this many workers "
                   "(default: in this process)")
    p.add_argument("--scheduler", help="or on an existing Dask scheduler")


def _recommend_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="a run directory of 'shardflow run'")
    p.add_argument("--user", required=True, help="the user's raw id, as the dataset spells it")
    p.add_argument("--k", type=int, help="items to print, best first (default: 10, or the whole list if shorter; at "
                   "most the run's nightly.top_k)")


def _promote_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="a run directory of 'shardflow run'")
    p.add_argument("--version", type=int, required=True, help="the finished version to make current")
    p.add_argument("--reason", default="rollback", help="why: one line of at most 500 characters (kept in "
                   "RUN_DIR/promotions.json)")


def _run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML file of config keys (see shardflow/config.py)")
    p.add_argument("--set", type=_set_value, action="append", metavar="KEY=VALUE", help="override one key (repeatable)")
    p.add_argument("--verbose", action="store_true", help="also show Dask's and the HTTP client's INFO logs")


# Each command: its name, its help, what runs it, what prints its result, and its arguments.
COMMANDS: tuple[tuple[str, str, Callable, Callable, Callable], ...] = (
    ("import", "import published dataset files into a dataset store",
     run_import, show_dataset, _import_args),
    ("synth", "generate a seeded synthetic Zipf dataset store",
     run_synth, show_dataset, _synth_args),
    ("profile", "count every row's accesses, in parallel on Dask",
     run_profile, show_profile, _profile_args),
    ("plan", "shard every row of a profiled dataset over a topology",
     run_plan, show_plan, _plan_args),
    ("train", "train on a Dask cluster following a plan (no Prefect)",
     run_train, show_train, _train_args),
    ("evaluate", "an exported model's held-out metrics: sampled candidates and the whole catalog",
     run_evaluate, show_evaluate, _evaluate_args),
    ("recommend", "one user's top items from the current version's newest list of them (Parquet under "
                   "RUN_DIR/versions)",
     run_recommend, show_recommend, _recommend_args),
    ("promote", "make a finished model version current (a rollback), recording who, when and why",
     run_promote, show_promote, _promote_args),
    ("run", "the whole retraining run as a Prefect flow (embedded API)",
     run_run, show_run, _run_args),
)


def command_parsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """Each command's own parser in `parser` (build_parser's), by name: what `shardflow NAME --help` prints."""
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(commands.choices)


class _Parser(argparse.ArgumentParser):
    """argparse's parser, refusing in one line as every other refusal does (argparse puts the whole usage first:
    17 lines for `shardflow train`); the line says where the usage is."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}; see '{self.prog} --help'\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="shardflow", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, help, run, show, arguments in COMMANDS:
        p = sub.add_parser(name, help=help, description=help)
        p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
        p.set_defaults(run=run, show=show)
        arguments(p)
    return parser
