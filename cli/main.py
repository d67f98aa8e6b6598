"""The `shardflow` command: one subcommand per stage.

Each subcommand prints a human-readable summary, or with --json a single JSON object
on stdout. Logs go to stderr. Bad input exits with status 2 and one line naming the
bad value and what is accepted.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from shardflow.errors import STORAGE_ERRNOS, InputError, TrainingError, WorkerLost, explained, interrupted

log = logging.getLogger("shardflow")


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


def _cmd_import(args: argparse.Namespace) -> dict:
    from storage.importers import DEFAULT_HASH_ROWS, import_dataset

    options = dict(
        overwrite=args.overwrite,
        append=args.append,
        replace_from=args.replace_from,
        settle_s=args.settle_s,
        table_rows=dict(args.table_rows or []),
        hash_rows=DEFAULT_HASH_ROWS if args.hash_rows is None else args.hash_rows,
        label=args.label,
    )
    started = time.perf_counter()
    if args.workers is None and args.scheduler is None:
        m = import_dataset(args.format, args.src, args.dest, **options)
    else:
        from shardflow.cluster import dask_client

        logging.getLogger("distributed").setLevel(logging.WARNING)
        with dask_client(args.scheduler, args.workers) as client:
            m = import_dataset(args.format, args.src, args.dest, client=client, **options)
    from storage.sources import not_parts

    return {
        **_dataset_summary(args.dest, m),
        "version": m["version"],
        "parts_added": m["parts_added"],
        "parts_skipped": m["parts_skipped"],
        "parts_waiting": m["parts_waiting"],
        "not_parts": not_parts(args.src),
        "seconds": time.perf_counter() - started,
    }


def _cmd_synth(args: argparse.Namespace) -> dict:
    from shardflow.data.synthetic import Repeats, parse_synth_table, synth_dataset

    tables = [parse_synth_table(t) for t in args.tables]
    m = synth_dataset(
        args.dest,
        tables,
        interactions=args.interactions,
        seed=args.seed,
        mean_length=args.mean_length,
        overwrite=args.overwrite,
        repeats=Repeats(args.repeat, args.repeat_window),
    )
    return _dataset_summary(args.dest, m)


def _dataset_summary(path: str, m: dict) -> dict:
    return {
        "path": str(path),
        "users": m["users"],
        "interactions": m["interactions"],
        "sequence_table": m["sequence_table"],
        "tables": {name: spec["rows"] for name, spec in m["tables"].items()},
        "checksum": m["checksum"],
    }


def _print_dataset(s: dict) -> None:
    print(f"dataset {s['path']}: {s['users']:,} users, {s['interactions']:,} interactions")
    if "version" in s:
        print(f"  version {s['version']}: {len(s['parts_added'])} parts added, {len(s['parts_skipped'])} already held"
              f" ({s['seconds']:.1f} s)")
        if s["not_parts"]:
            print(f"  skipped {len(s['not_parts'])} entries that are not parts: {', '.join(s['not_parts'][:5])}")
        if s["parts_waiting"]:
            print(f"  left {len(s['parts_waiting'])} unfinished parts for later: {', '.join(s['parts_waiting'][:5])}")
    for name, rows in s["tables"].items():
        role = "item sequence" if name == s["sequence_table"] else "feature"
        print(f"  table {name:<12} {rows:>14,} rows  ({role})")
    print(f"  checksum {s['checksum']}")


def _cmd_profile(args: argparse.Namespace) -> dict:
    from shardflow.cluster import dask_client, worker_count
    from shardflow.profiling.profiles import check_inputs, profile_dataset

    logging.getLogger("distributed").setLevel(logging.WARNING)
    out = args.out or f"{args.dataset.rstrip('/')}.profile"
    check_inputs(args.dataset, out, overwrite=args.overwrite)
    started = time.perf_counter()
    with dask_client(args.scheduler, args.workers) as client:
        workers = worker_count(client)
        log.info("profiling %s on %d workers (%s)", args.dataset, workers, client.scheduler.address)
        m = profile_dataset(args.dataset, out, client=client, overwrite=args.overwrite)
    return {"profile": out, "workers": workers, "seconds": time.perf_counter() - started, "tables": m["tables"]}


def _print_profile(s: dict) -> None:
    print(f"profile {s['profile']} ({s['workers']} workers, {s['seconds']:.1f} s)")
    print(f"  {'table':<12} {'rows':>14} {'accesses':>14} {'distinct':>14} {'top 1%':>7} {'top 10%':>8} {'slope':>6}")
    for name, t in s["tables"].items():
        print(
            f"  {name:<12} {t['rows']:>14,} {t['accesses']:>14,} {t['distinct']:>14,} "
            f"{t['top1pct_share']:>7.3f} {t['top10pct_share']:>8.3f} {t['zipf_slope']:>6.2f}"
        )


def _cmd_plan(args: argparse.Namespace) -> dict:
    from shardflow.planner.costmodel import StepShape
    from shardflow.planner.topology import load_topology
    from shardflow.planning.plans import make_plan

    topology = load_topology(args.topology)
    shape = StepShape(args.batch_size, args.dim, args.dedup)
    out = args.out or str(Path(args.profile).resolve().parent / f"plan-{args.strategy}")
    summary = make_plan(
        args.profile,
        out,
        topology,
        strategy=args.strategy,
        shape=shape,
        memory_slack=args.memory_slack,
        history=args.history,
        negatives=args.negatives,
        overwrite=args.overwrite,
    )
    return {"plan": out, **summary}


def _print_plan(s: dict) -> None:
    mb = 1e6
    memory = s["memory_bytes_per_device"]
    print(f"plan {s['plan']}: {s['strategy']} on {s['devices']} devices, de-duplication scope '{s['dedup']}'")
    some = s["node_rows_on_some_nodes"]
    print(f"  tiers            global {s['tiers']['global']:,}  node {s['tiers']['node']:,}"
          f"{f' ({some:,} on some nodes only)' if some else ''}  single {s['tiers']['single']:,}")
    print(f"  memory/device    max {max(memory) / mb:,.1f} MB of a {s['budget_bytes_per_device'] / mb:,.1f} MB budget")
    print(
        f"  bytes/step       lookup {s['lookup_bytes_per_step'] / mb:,.3f} "
        f"MB  sync {s['sync_bytes_per_step'] / mb:,.3f} MB"
        f"  inter-node {s['inter_node_bytes_per_step'] / mb:,.3f} MB"
    )
    print(f"  comm time/step   {s['comm_time_s_per_step'] * 1e6:,.2f} us (busiest: {s['busiest_link']});"
          f" row-wise-mod {s['row_wise_mod_comm_time_s_per_step'] * 1e6:,.2f} us;"
          f" bound {s['lower_bound_comm_time_s_per_step'] * 1e6:,.2f} us; gap closed {s['gap_closed']:.3f}")


def _cmd_train(args: argparse.Namespace) -> dict:
    from shardflow.cluster import dask_client
    from shardflow.training.device import torch_device
    from shardflow.training.config import TrainConfig
    from shardflow.training.run import train_from_stores
    from shardflow.planning.plans import read_plan

    logging.getLogger("distributed").setLevel(logging.WARNING)
    _, topology, shape, _ = read_plan(args.plan)
    train = TrainConfig(
        batch_size=shape.batch_size if args.batch_size is None else args.batch_size,
        dedup=shape.dedup if args.dedup is None else args.dedup,
        early_answers=args.early_answers,
        epochs=args.epochs,
        patience=args.patience,
        max_steps=args.max_steps,
        device=args.device,
        seed=args.seed,
        eval_users=args.eval_users or None,
    )
    torch_device(args.device)  # refused here, before a cluster starts, if this machine has no GPU
    with dask_client(
        args.scheduler, None if args.scheduler else topology.devices, gpus=args.device == "cuda"
    ) as client:
        return train_from_stores(
            args.dataset,
            args.plan,
            client,
            train,
            encoder={"encoder": args.encoder, "blocks": args.attention_blocks, "heads": args.attention_heads,
                     "dropout": args.dropout},
            estimate=args.estimate,
            server_memory_bytes=args.server_memory,
        )


def _print_train(s: dict) -> None:
    mb = 1e6
    m = s["model"]
    encoder = f", {m['encoder']} encoder" if m["kind"] == "sequence" else ""
    print(f"trained {s['strategy']} on {s['devices']} devices{encoder}: {s['steps']:,} steps, {s['examples']:,} "
          f"examples, {s['examples_per_s']:,.0f} examples/s")
    from shardflow.training.evaluate import metric_text
    from shardflow.training.validation import unprefixed

    print(f"  loss {s['loss']:.4f}   {metric_text(s)}  ({s['eval_users']:,} held-out examples)")
    if s["best_epoch"] is not None:
        print(f"  epoch {s['best_epoch']} of {s['epochs_trained']} kept: the best on the validation split "
              f"({metric_text(unprefixed(s))}; patience {s['patience']})")
    print(f"  bytes/step  measured {s['measured_bytes_per_step'] / mb:,.3f} MB,"
          f" cost model {s['predicted_bytes_per_step'] / mb:,.3f} MB (dedup {s['dedup']}),"
          f" and {s['bytes_per_step']['patch'] / mb:,.3f} MB of rows changed after an early answer sent again")
    t = s["seconds_per_step"]
    print("  ms/step     " + "  ".join(f"{k} {v * 1e3:.1f}" for k, v in t.items()))


def _set_value(text: str) -> tuple[str, object]:
    from shardflow.safe_yaml import load_text

    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r}; accepted: KEY=VALUE, e.g. epochs=3")
    try:
        return key, load_text(value, f"--set {key}")
    except InputError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _cmd_run(args: argparse.Namespace) -> dict:
    import os

    from shardflow.config import RetrainConfig
    from shardflow.safe_yaml import load_file

    # The embedded server would try to send usage telemetry; these machines may have no network.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    values: dict = {}
    if args.config:
        values = load_file(args.config, "config") or {}
        if not isinstance(values, dict):
            raise InputError(f"--config {args.config}: a {type(values).__name__}; accepted: a YAML mapping")
    values.update(dict(args.set or []))
    config = RetrainConfig.build(values)
    from shardflow.preflight import check_run

    check_run(config)
    from tasks.versions import nothing_new

    idle = nothing_new(config)  # a night with nothing new: answered from the stores, no Prefect API, no cluster
    if idle is not None:
        return idle
    from shardflow.cluster import VERBOSE, quiet_dask

    if args.verbose:
        os.environ[VERBOSE] = "1"
    quiet_dask()
    from flows.api import embedded_api, terminated_as_interrupt
    from flows.retrain import retrain

    with terminated_as_interrupt(), embedded_api():
        return retrain(config)


def _print_run(s: dict) -> None:
    from shardflow.training.evaluate import metric_text

    mb = 1e6
    if not s["trained"]:
        print(f"run {s['run_dir']}: {s['message']}; version {s['current']} is current ({metric_text(s)})")
    else:
        start = f"warm start from version {s['warm_start_from']}" if s["warm_start_from"] else "cold start"
        print(f"run {s['run_dir']}: version {s['version']} ({start}, {len(s['parts_added'])} part(s) imported), "
              f"{s['epochs']} epochs, {metric_text(s)}")
        if s["previous_auc"] is not None:
            print(f"  version {s['warm_start_from']} on the same held-out items: AUC {s['previous_auc']:.4f}")
        print(f"  {'promoted: version ' + str(s['version']) + ' is current' if s['promoted'] else s['message']}")
        verb = "kept" if not s["replanned"] else "made" if s["warm_start_from"] is None else "re-made"
        print(f"  plan {verb}: {s['replan_reason']}")
    measured = "not measured" if s["bytes_per_step"] is None else f"{s['bytes_per_step'] / mb:,.3f} MB measured"
    print(f"  traffic/step {measured}, {s['modeled_bytes_per_step'] / mb:,.3f} MB modeled for this plan")
    print(f"  comm time/step (modeled) {s['comm_time_us_per_step']:,.1f} µs; row-wise-mod "
          f"{s['row_wise_comm_time_us_per_step']:,.1f} µs, {s['row_wise_bytes_per_step'] / mb:,.3f} MB")
    print(
        f"  model        {s['model']} (downloaded {s['downloads']} "
        f"time{'s' if s['downloads'] != 1 else ''} by this run)"
    )
    for c in s["checkpoints"]:
        print(f"  checkpoint   {c}")
    for p in s["plots"]:
        print(f"  plot         {p}")
    for w in s["warnings"]:
        print(f"  warning      {w}")
    print("  artifacts, logs and task runs: the Prefect UI (prefect server start), or 'prefect flow-run ls'")


def _cmd_promote(args: argparse.Namespace) -> dict:
    from storage import versions

    return {"run_dir": args.run_dir, **versions.rollback(args.run_dir, args.version, args.reason)}


def _print_promote(s: dict) -> None:
    was = "no version" if s["previous"] is None else f"version {s['previous']}"
    print(f"run {s['run_dir']}: version {s['version']} is current (was {was}); recorded: by {s['by']} at {s['at']}"
          f" ({s['reason']}). The next run warm-starts from version {s['version']}.")


def _config_flag(p: argparse.ArgumentParser, key: str, **given) -> None:
    """--KEY for the config key `key`, its type, choices, default and help taken from RetrainConfig (the one
    source of every default: `shardflow plan`, `train` and `run` agree); `given` adds or replaces any of them."""
    from typing import Literal, get_args, get_origin

    from shardflow.config import RetrainConfig

    field = RetrainConfig.model_fields[key]
    kind, default = field.annotation, field.default
    spec: dict = {"default": default, "help": (field.description or key.replace("_", " ")).replace("%", "%%")}
    if kind is bool:
        spec["action"] = "store_true"
    elif get_origin(kind) is Literal:
        spec["choices"] = list(get_args(kind))
    else:
        spec["type"] = kind
    spec.update(given)
    if spec.get("required"):
        spec.pop("default")
    else:
        spec["help"] += f" (default: {default})"
    p.add_argument("--" + key.replace("_", "-"), **spec)


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
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--mean-length", type=float, default=20.0, help="mean sequence length per user")
    p.add_argument("--repeat", type=float, default=0.0,
                   help="share of events that repeat one of the user's last --repeat-window items (session data)")
    p.add_argument("--repeat-window", type=int, default=5)
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
    p.add_argument("--out", help="plan store to create (default: plan-STRATEGY beside the profile)")
    p.add_argument("--overwrite", action="store_true", help="replace a plan already at --out")


def _train_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("dataset", help="dataset store")
    p.add_argument("--plan", required=True, help="plan store of this dataset")
    _config_flag(p, "epochs")
    _config_flag(p, "patience", type=int)
    p.add_argument("--max-steps", type=int, help="stop after this many steps in all")
    p.add_argument("--batch-size", type=int, help="global batch (default: the plan's)")
    p.add_argument("--dedup", choices=["none", "device", "node"], help="de-duplication scope (default: the plan's)")
    _config_flag(p, "early_answers", help="answer the next step's row requests while waiting, patch them when it "
                 "begins")
    _config_flag(p, "device", help="where each device computes: the CPU, or CUDA device d on worker d (resource "
                 "GPU=1)")
    _config_flag(p, "seed")
    for key in ("encoder", "attention_blocks", "attention_heads", "dropout"):
        _config_flag(p, key)
    _config_flag(p, "eval_users", type=int, help="held-out users evaluated (0: all)")
    p.add_argument("--estimate", action="store_true", help="estimation mode: every table on one parameter server")
    p.add_argument("--server-memory", type=int, help="estimation: the server's bytes (default: the topology's)")
    p.add_argument("--scheduler", help="address of an existing Dask scheduler (one worker per device)")


def _promote_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="a run directory of 'shardflow run'")
    p.add_argument("--version", type=int, required=True, help="the finished version to make current")
    p.add_argument("--reason", default="rollback", help="why (kept in RUN_DIR/promotions.json)")


def _run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML file of config keys (see shardflow/config.py)")
    p.add_argument("--set", type=_set_value, action="append", metavar="KEY=VALUE", help="override one key (repeatable)")
    p.add_argument("--verbose", action="store_true", help="also show Dask's and the HTTP client's INFO logs")


# Each command: its name, its help, what runs it, what prints its result, and its arguments.
COMMANDS: tuple[tuple[str, str, Callable, Callable, Callable], ...] = (
    ("import", "import published dataset files into a dataset store",
     _cmd_import, _print_dataset, _import_args),
    ("synth", "generate a seeded synthetic Zipf dataset store",
     _cmd_synth, _print_dataset, _synth_args),
    ("profile", "count every row's accesses, in parallel on Dask",
     _cmd_profile, _print_profile, _profile_args),
    ("plan", "shard every row of a profiled dataset over a topology",
     _cmd_plan, _print_plan, _plan_args),
    ("train", "train on a Dask cluster following a plan (no Prefect)",
     _cmd_train, _print_train, _train_args),
    ("promote", "make a finished model version current (a rollback), recording who, when and why",
     _cmd_promote, _print_promote, _promote_args),
    ("run", "the whole retraining run as a Prefect flow (embedded API)",
     _cmd_run, _print_run, _run_args),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardflow", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, help, run, show, arguments in COMMANDS:
        p = sub.add_parser(name, help=help, description=help)
        p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
        p.set_defaults(run=run, show=show)
        arguments(p)
    return parser


_KEPT = "every complete checkpoint and store is kept: run the same command again to resume"


class _Interrupts:
    """Ctrl-C raises KeyboardInterrupt, as ever, and the command winds down (its cluster, its API server) to
    say so in one line. A second Ctrl-C ends the process at once: with that line if it was not said yet,
    silently if it was. Every store is written by a rename, so stopping anywhere keeps what is complete.
    """

    def __init__(self, command: str) -> None:
        self.command, self.said = command, False
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, self._first)
        # Stopped at once, the process leaves its local workers' semaphores to multiprocessing's resource
        # tracker, which removes them and warns once per process on the terminal; it takes its warning
        # filters from these options when it starts.
        sys.warnoptions.append("ignore:resource_tracker:UserWarning")

    def _first(self, signum, frame) -> None:
        signal.signal(signal.SIGINT, self._again)
        raise KeyboardInterrupt

    def _again(self, signum, frame) -> None:
        if not self.said:
            os.write(2, f"shardflow {self.command}: interrupted twice, stopped at once; {_KEPT}\n".encode())
        os._exit(130)

    def say(self, line: str) -> None:
        print(line, file=sys.stderr, flush=True)
        self.said = True


class _Terminal(logging.Formatter):
    """Log lines for the terminal: an error shardflow explains in one line (bad input, a run that stopped,
    an interrupt, a file system that refuses writes) is logged without its traceback, which the Prefect
    API's log (the UI) keeps."""

    def format(self, record: logging.LogRecord) -> str:
        if record.exc_info and explained(record.exc_info[1], record.name):
            record = logging.makeLogRecord({**record.__dict__, "exc_info": None, "exc_text": None})
        return super().format(record)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    terminal = logging.StreamHandler(sys.stderr)
    terminal.setFormatter(_Terminal("%(asctime)s %(name)s %(levelname)s %(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[terminal])
    interrupts = _Interrupts(args.command)
    try:
        summary = args.run(args)
    except InputError as e:
        print(f"shardflow {args.command}: error: {e}", file=sys.stderr)
        return 2
    except TrainingError as e:
        print(f"shardflow {args.command}: training stopped: {e}", file=sys.stderr)
        return 3
    except WorkerLost as e:  # a run restores from its last checkpoint first; `train` keeps none
        then = (_KEPT if args.command == "run" else "`shardflow train` keeps no checkpoints: run it again on a whole "
                "cluster, or use `shardflow run`, which restores the last one")
        print(f"shardflow {args.command}: training stopped: {e}; {then}", file=sys.stderr)
        return 3
    except OSError as e:
        if interrupted(e):
            interrupts.say(f"shardflow {args.command}: interrupted; {_KEPT}")
            return 130
        if e.errno not in STORAGE_ERRNOS:
            raise
        print(f"shardflow {args.command}: stopped: {e}; {_KEPT} once the file system accepts writes again",
              file=sys.stderr)
        return 4
    except BaseException as e:
        if interrupted(e):
            interrupts.say(f"shardflow {args.command}: interrupted; {_KEPT}")
            return 130
        if type(e).__name__ != "Terminated":  # flows.api.Terminated (SIGTERM), not imported unless a run started
            raise
        interrupts.say(f"shardflow {args.command}: terminated (SIGTERM); {_KEPT}")
        return 143
    if args.json:
        json.dump(summary, sys.stdout)
        sys.stdout.write("\n")
    else:
        args.show(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
