"""What each `shardflow` subcommand does (run_NAME, returning its summary) and how it prints the summary
without --json (show_NAME). Heavy imports stay inside the commands: `shardflow --help` imports none."""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

from shardflow.errors import InputError

log = logging.getLogger("shardflow")


def run_import(args: argparse.Namespace) -> dict:
    from storage.importers import DEFAULT_HASH_ROWS, import_dataset

    named = [name for name, _ in args.table_rows or []]
    twice = sorted({name for name in named if named.count(name) > 1})
    if twice:
        raise InputError(f"--table-rows {', '.join(twice)} given twice; accepted: each table's size once")
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
        **dataset_summary(args.dest, m.manifest),
        "version": m.manifest["version"],
        "parts_added": list(m.parts_added),
        "parts_skipped": list(m.parts_skipped),
        "parts_waiting": list(m.parts_waiting),
        "not_parts": not_parts(args.src),
        "seconds": time.perf_counter() - started,
    }


def run_synth(args: argparse.Namespace) -> dict:
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
    return dataset_summary(args.dest, m)


def dataset_summary(path: str, m: dict) -> dict:
    return {
        "path": str(path),
        "users": m["users"],
        "interactions": m["interactions"],
        "sequence_table": m["sequence_table"],
        "tables": {name: spec["rows"] for name, spec in m["tables"].items()},
        "widths": {name: spec["width"] for name, spec in m["tables"].items() if "width" in spec},
        "checksum": m["checksum"],
    }


def show_dataset(s: dict) -> None:
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
        if name in s["widths"]:
            role = f"feature, up to {s['widths'][name]} tokens an example"
        print(f"  table {name:<12} {rows:>14,} rows  ({role})")
    print(f"  checksum {s['checksum']}")


def run_profile(args: argparse.Namespace) -> dict:
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
    return {"profile": out, "workers": workers, "seconds": time.perf_counter() - started,
            "tables": {name: s.to_dict() for name, s in m.tables.items()}}


def show_profile(s: dict) -> None:
    print(f"profile {s['profile']} ({s['workers']} workers, {s['seconds']:.1f} s)")
    print(f"  {'table':<12} {'rows':>14} {'accesses':>14} {'distinct':>14} {'top 1%':>7} {'top 10%':>8} {'slope':>6}")
    for name, t in s["tables"].items():
        print(
            f"  {name:<12} {t['rows']:>14,} {t['accesses']:>14,} {t['distinct']:>14,} "
            f"{t['top1pct_share']:>7.3f} {t['top10pct_share']:>8.3f} {t['zipf_slope']:>6.2f}"
        )


def run_plan(args: argparse.Namespace) -> dict:
    from shardflow.config_sections import workload
    from shardflow.model.sizes import WORKLOAD_DEFAULTS
    from shardflow.planner.costmodel import StepShape
    from shardflow.planner.topology import load_topology
    from shardflow.sharding.stage import make_plan
    from storage.profile import Profile

    topology = load_topology(args.topology)
    rows = args.row_optimizer or WORKLOAD_DEFAULTS[workload({"dataset": Profile.open(args.profile).dataset.path})][
        "row_optimizer"]
    shape = StepShape(args.batch_size, args.dim, args.dedup, rows)
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
    return {"plan": out, **summary.to_dict()}


def show_plan(s: dict) -> None:
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


def run_train(args: argparse.Namespace) -> dict:
    from shardflow.cluster import dask_client
    from shardflow.model.configs import OptimizerConfig
    from shardflow.sharding.stage import read_plan
    from shardflow.training.config import TrainConfig
    from shardflow.training.device import torch_device
    from shardflow.training.run import prepare, train_job

    logging.getLogger("distributed").setLevel(logging.WARNING)
    stored = read_plan(args.plan)
    topology, shape = stored.topology, stored.shape
    train = TrainConfig(
        batch_size=shape.batch_size if args.batch_size is None else args.batch_size,
        dedup=shape.dedup if args.dedup is None else args.dedup,
        early_answers=args.early_answers,
        transport=args.transport,
        epochs=args.epochs,
        patience=args.patience or None,
        min_epochs=args.min_epochs,
        max_steps=args.max_steps,
        device=args.device,
        seed=args.seed,
        eval_users=args.eval_users or None,
        full_ranking=args.full_ranking,
    )
    if args.scheduler is None:
        torch_device(args.device)  # refused here, before a local cluster starts, if this machine has no GPU
    if args.server_memory is not None and not args.estimate:
        raise InputError(f"--server-memory {args.server_memory} without --estimate; accepted: --server-memory "
                         "with --estimate (the bytes of its one parameter server)")
    job = prepare(args.dataset, args.plan, train,  # every value refused here, before a cluster starts
                  optimizer=OptimizerConfig(rows=args.row_optimizer or shape.row_optimizer, row_lr=args.row_lr),
                  encoder={"encoder": args.encoder, "blocks": args.attention_blocks, "heads": args.attention_heads,
                           "dropout": args.dropout, "item_dropout": args.item_dropout, "loss": args.loss,
                           "gbce_t": args.gbce_t},
                  estimate=args.estimate, server_memory_bytes=args.server_memory)
    with dask_client(args.scheduler, None if args.scheduler else topology.devices) as client:
        return train_job(client, job).record()


def show_train(s: dict) -> None:
    mb = 1e6
    m = s["model"]
    encoder = f", {m['encoder']} encoder" if m["kind"] == "sequence" else ""
    print(f"trained {s['strategy']} on {s['devices']} devices{encoder}, rows {s['row_optimizer']}: {s['steps']:,} "
          f"steps, {s['examples']:,} examples, {s['examples_per_s']:,.0f} examples/s")
    from shardflow.model.metrics import Metrics

    print(f"  loss {s['loss']:.4f}   {Metrics.read(s).text()}  ({s['eval_users']:,} held-out examples)")
    if s["best_epoch"] is not None:
        print(f"  epoch {s['best_epoch']} of {s['epochs_trained']} kept: the best on the validation split "
              f"({Metrics.read(s, 'val_').text()}; patience {s['patience']})")
    print(f"  bytes/step  measured {s['measured_bytes_per_step'] / mb:,.3f} MB,"
          f" cost model {s['predicted_bytes_per_step'] / mb:,.3f} MB (dedup {s['dedup']}),"
          f" and {s['bytes_per_step']['patch'] / mb:,.3f} MB of rows changed after an early answer sent again")
    t = s["seconds_per_step"]
    print("  ms/step     " + "  ".join(f"{k} {v * 1e3:.1f}" for k, v in t.items()))


def run_run(args: argparse.Namespace) -> dict:
    from cli.launch import launch
    from shardflow.config import RetrainConfig
    from shardflow.config_sections import overridden
    from shardflow.safe_yaml import load_file

    values: dict = {}
    if args.config:
        values = load_file(args.config, "config") or {}
        if not isinstance(values, dict):
            raise InputError(f"--config {args.config}: a {type(values).__name__}; accepted: a YAML mapping")
    try:
        values = overridden(values, dict(args.set or []))
    except ValueError as e:
        raise InputError(f"bad configuration: {e}") from None
    return launch(RetrainConfig.build(values), verbose=args.verbose)


def show_run(values: dict) -> None:
    from shardflow.reporting.summary import RunSummary

    mb, s = 1e6, RunSummary.parse(values)
    t, p = s.training, s.plan
    if not s.trained:
        print(f"run {s.run_dir}: {s.message}; version {s.current} is current ({s.held_out.text()})")
    else:
        start = f"warm start from version {s.warm_start_from}" if s.warm_start_from else "cold start"
        print(f"run {s.run_dir}: version {s.version} ({start}, {len(s.parts_added)} part(s) imported), "
              f"{t.epochs} epoch{'' if t.epochs == 1 else 's'}, {s.held_out.text()}")
        if s.previous.auc is not None:
            print(f"  version {s.warm_start_from} on the same held-out items: AUC {s.previous.auc:.4f}")
        print(f"  {f'promoted: version {s.version} is current' if s.promoted else s.message}")
        verb = "kept" if not p.replanned else "made" if s.warm_start_from is None else "re-made"
        print(f"  plan {verb}: {p.replan_reason}")
    measured = "not measured" if t.bytes_per_step is None else f"{t.bytes_per_step / mb:,.3f} MB measured"
    print(f"  traffic/step {measured}, {p.modeled_bytes_per_step / mb:,.3f} MB modeled for this plan")
    print(f"  comm time/step (modeled) {p.comm_time_us_per_step:,.1f} µs; row-wise-mod "
          f"{p.row_wise_comm_time_us_per_step:,.1f} µs, {p.row_wise_bytes_per_step / mb:,.3f} MB")
    print(f"  model        {t.model} (downloaded {t.downloads} time{'s' if t.downloads != 1 else ''} by this run)")
    if s.recommendations:
        print(f"  top-K lists  {s.recommendations} (Parquet; one user's: shardflow recommend {s.run_dir} --user ID)")
    if s.dask_report:
        print(f"  Dask report  {s.dask_report} (HTML: task stream, workers' profiles, bandwidth)")
    for c in t.checkpoints:
        print(f"  checkpoint   {c}")
    for p in s.plots:
        print(f"  plot         {p}")
    for w in s.warnings:
        print(f"  warning      {w}")
    print("  artifacts, logs and task runs: the Prefect UI (prefect server start), or 'prefect flow-run ls'")


def run_evaluate(args: argparse.Namespace) -> dict:
    """An exported model's held-out metrics: sampled candidates, and (sequences) the whole catalog."""
    from shardflow.cluster import dask_client, quiet_dask
    from shardflow.training.config import check_seed
    from shardflow.training.evaluate import evaluate_export

    quiet_dask()
    check_seed(args.seed)
    if args.users is not None and args.users < 1:
        raise InputError(f"--users {args.users}; accepted: an integer >= 1, or leave it out for every user")
    started = time.perf_counter()
    if args.workers is None and args.scheduler is None:
        metrics = evaluate_export(args.model, args.dataset, args.users, args.seed, full=args.full_ranking)
    else:
        with dask_client(args.scheduler, args.workers) as client:
            metrics = evaluate_export(args.model, args.dataset, args.users, args.seed, full=args.full_ranking,
                                      client=client)
    return {"model": args.model, "dataset": args.dataset, "eval_users": metrics.users,
            **metrics.values(full=True), "seconds": time.perf_counter() - started}


def show_evaluate(s: dict) -> None:
    from shardflow.model.metrics import Metrics

    print(f"model {s['model']} on {s['dataset']}: {Metrics.read(s).text()} ({s['eval_users']:,} held-out "
          f"examples, {s['seconds']:.1f} s)")
    if s["full_hr_at_20"] is not None:
        print(f"  full catalog @20: HR {s['full_hr_at_20']:.4f}, NDCG {s['full_ndcg_at_20']:.4f}")


def run_recommend(args: argparse.Namespace) -> dict:
    """One user's list from the current version: the newest its nights wrote for that user (a night lists the
    users of its new parts; after a rollback, the lists of the version rolled back to)."""
    from storage import recommendations, versions

    if args.k is not None and args.k < 1:
        raise InputError(f"--k {args.k}; accepted: an integer >= 1")
    version, stores = versions.current_recommendations(args.run_dir)
    k = min(recommendations.read(s)["k"] for s in stores)
    if args.k is not None and args.k > k:
        raise InputError(f"--k {args.k}; accepted: 1 to {k} (the lists of version {version}: nightly.top_k)")
    for store in stores:
        items = recommendations.find(store, args.user)
        if items is not None:
            shown = items[: min(10, k) if args.k is None else args.k]
            return {"user": args.user, "version": version, "items": [{"item": i, "score": v} for i, v in shown]}
    raise recommendations.missing(stores[0], args.user, len(stores) - 1)


def show_recommend(s: dict) -> None:
    print(f"user {s['user']}: top {len(s['items'])} of version {s['version']}")
    for rank, item in enumerate(s["items"], 1):
        print(f"{rank:>5}  {item['item']}  {item['score']:.4f}")


def run_promote(args: argparse.Namespace) -> dict:
    from shardflow.records import plain
    from storage import versions

    record = versions.rollback(args.run_dir, args.version, args.reason)
    return {"run_dir": args.run_dir, **plain(record), "published": _announce(args.run_dir, record)}


def _announce(run_dir: str, record) -> str | None:
    """With PREFECT_API_URL set: the rolled-back event and the versions and promotions tables published (as the
    rollback deployment does), None once done, else why not (the promotion stands either way)."""
    import os

    if not os.environ.get("PREFECT_API_URL"):
        return "PREFECT_API_URL is not set: the UI's versions table shows it after the next run"
    import logging
    import warnings

    from tasks.reports import announce_rollback

    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request on the terminal otherwise
    try:
        with warnings.catch_warnings():
            # Prefect 3.8 warns that an artifact made outside a flow run will not be accepted some day; this is
            # the operator's own command, with no flow run to make it in.
            warnings.filterwarnings("ignore", "Artifact creation outside", FutureWarning)
            announce_rollback(run_dir, record)
    except Exception as e:  # noqa: BLE001 (the promotion is recorded; the UI is told at the next run)
        return f"the Prefect API refused it ({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''})"
    return None


def show_promote(s: dict) -> None:
    was = "no version" if s["previous"] is None else f"version {s['previous']}"
    print(f"run {s['run_dir']}: version {s['version']} is current (was {was}); recorded: by {s['by']} at {s['at']}"
          f" ({s['reason']}). The next run warm-starts from version {s['version']}.")
    print("the Prefect UI's versions and promotions tables are updated" if s["published"] is None
          else f"not shown in the Prefect UI yet: {s['published']}")
