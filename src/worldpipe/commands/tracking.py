"""`worldpipe tracking ...` (spooled records of a run directory) and `worldpipe compare` (runs side by side)."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path

import click

from worldpipe.commands import command, group, overrides
from worldpipe.config.paths import COMPLETION_RECORD

log = logging.getLogger("worldpipe.tracking")


def register(cli: click.Group) -> None:
    tracking = group("tracking", "MLflow records of a run directory")
    run_dir = click.Argument(["run_dir"])
    for cmd in (
        command("sync", _sync, "Replay records spooled while tracking was unreachable (idempotent).\n\n"
                "RUN_DIR: run directory (holding tracking/journal.jsonl).", [
                    run_dir, click.Option(["--tracking-uri"], help="default: the URI the run recorded to"),
                    click.Option(["--mark-killed"], is_flag=True, help="if the training process died without "
                                                                      "ending the run, record it as KILLED")],
                short="replay records spooled while tracking was unreachable (idempotent)"),
        command("status", _status, "Run id, acknowledged and pending records of RUN_DIR.", [run_dir]),
        command("server", _server, "Run an MLflow tracking server (PostgreSQL backend for clusters).\n\n"
                "Arguments after `--` go to `mlflow server` as they are.", [
                    click.Option(["--backend-store-uri"], help="postgresql://USER:PASSWORD@HOST:PORT/DB "
                                                               "(default: sqlite:///results/mlflow.db)"),
                    click.Option(["--artifacts-destination"], help="artifact root, on the shared filesystem "
                                                                   "(default: results/mlartifacts)"),
                    click.Option(["--host"], help="address to bind (default 127.0.0.1: this machine only; "
                                                  "0.0.0.0 opens it to the network, without authentication)"),
                    click.Option(["--port"], type=int, help="default 5000"),
                    click.Option(["--workers"], type=int, default=1, show_default=True, help="server workers"),
                    click.Option(["--print-command"], is_flag=True, help="print the mlflow command instead"),
                    overrides("[-- MLFLOW SERVER OPTIONS]...")], pass_on=True,
                short="run an MLflow tracking server (PostgreSQL backend for clusters)"),
    ):
        tracking.add_command(cmd)
    cli.add_command(tracking)
    cli.add_command(command("compare", _compare, "Differing params and evaluation metrics of runs (or of a sweep) "
                            "side by side; optionally a metric-vs-swept-key plot.\n\nRUN: run id, sweep parent "
                            "run id (all its runs), or a JSON file naming one (train_done.json, a sweep's "
                            "parent.json).", [
        click.Argument(["run_ids"], nargs=-1, required=True, metavar="RUN..."),
        click.Option(["--tracking-uri"], help="default: $MLFLOW_TRACKING_URI, else results/mlflow.db"),
        click.Option(["--plot"], help="PNG to write: the metric against the first swept key, seeds as error bars"),
        click.Option(["--metric"], help="metric of the plot (default eval/one_step_ratio)"),
        click.Option(["--x", "x_key"], help="param on the plot's x axis (default: the first swept key)"),
        click.Option(["--out"], help="also write the table to this file (atomically)"),
        click.Option(["--json", "as_json"], is_flag=True, help="print the comparison as JSON instead of a table"),
        click.Option(["--csv", "as_csv"], is_flag=True, help="print it as CSV (section,key,one column per run)"),
    ], short="differing params and evaluation metrics of runs (or of a sweep) side by side"))


def _last_open(spool) -> dict:
    opens = [r for r in spool.records() if r["op"] == "open"]
    return opens[-1] if opens else {}


def checkpoint_probe(checkpoint_dir: str | None) -> Callable[[int], bool | None]:
    """For a dead writer: metrics gated on step S are final iff an intact checkpoint >= S exists."""

    def probe(gate: int) -> bool | None:
        if not checkpoint_dir:
            return None
        try:
            # Imported on use: the CLI's other commands need no torch (seconds of start-up).
            from worldpipe.checkpoint import CheckpointManager

            latest = CheckpointManager(checkpoint_dir).latest_intact()
        except Exception as err:  # noqa: BLE001 - an unreadable store decides nothing
            log.warning("cannot inspect checkpoints in %s (%s); leaving staged metrics pending", checkpoint_dir, err)
            return None
        # No intact checkpoint >= gate: the next resume starts earlier and recomputes these steps.
        return latest is not None and latest >= gate

    return probe


def _sync(args) -> int:
    from worldpipe.core.atomic import write_text_atomic
    from worldpipe.tracking.delivery import deliver
    from worldpipe.tracking.spool import Spool

    spool = Spool(args.run_dir)
    if not spool.journal.exists():
        from worldpipe.core.errors import UsageError

        raise UsageError(f"{spool.journal} does not exist (no records spooled in {args.run_dir})")
    opened = _last_open(spool)
    uri = args.tracking_uri or opened.get("uri") or spool.state()["uri"]
    live = spool.writer_alive()
    records = spool.records()
    last_open = max((i for i, r in enumerate(records) if r["op"] == "open"), default=None)
    if args.mark_killed and not live and last_open is not None and \
            not any(r["op"] == "end" for r in records[last_open:]):
        spool.append("end", status="KILLED")
    # A dead writer's staged metrics are decided by its checkpoints; a live one decides them itself.
    probe = None if live else checkpoint_probe(opened.get("checkpoint_dir"))
    report = deliver(spool, uri, probe)
    print(f"run {report.run_id}: delivered {report.delivered}, voided {report.voided}, rejected {report.rejected}, "
          f"pending {report.pending}" + (" (a training process is writing this run)" if live else ""))
    if report.error:
        print(f"error: tracking at {uri} failed: {report.error}", file=sys.stderr)
        return 1
    done = Path(args.run_dir) / COMPLETION_RECORD
    if report.run_id and done.exists():
        record = json.loads(done.read_text())
        if not record.get("mlflow_run_id"):  # trained while tracking was unreachable from the start
            record["mlflow_run_id"] = report.run_id
            write_text_atomic(done, json.dumps(record, indent=2))
    return 0 if report.pending == 0 or live else 1


def _status(args) -> int:
    from worldpipe.tracking.spool import Spool

    spool = Spool(args.run_dir)
    if not spool.journal.exists():
        from worldpipe.core.errors import UsageError

        raise UsageError(f"{spool.journal} does not exist (no records spooled in {args.run_dir})")
    state = spool.state()
    pending = spool.pending()
    print(f"run_id: {state['run_id']}\nuri: {state['uri'] or _last_open(spool).get('uri')}\n"
          f"acknowledged: {state['acked']}\npending: {len(pending)}")
    for record in pending:
        extra = record.get("gate", record.get("step", record.get("path", "")))
        print(f"  {record['seq']:>6}  {record['op']:<10} {extra}")
    for rejected in state["rejected"]:
        print(f"  rejected {rejected['seq']}: {rejected['error']}")
    return 0


def _compare(args) -> int:
    from worldpipe.core.atomic import write_text_atomic
    from worldpipe.tracking.comparison import (
        DEFAULT_METRIC,
        ComparisonError,
        comparison_csv,
        comparison_json,
        comparison_table,
        plot_comparison,
        resolve,
        run_ids_of,
    )
    from worldpipe.tracking.connection import client_for

    if args.as_json and args.as_csv:
        raise ComparisonError("--json and --csv exclude each other")
    run_ids = run_ids_of(args.run_ids)  # a missing file is named before a tracking store is opened (or created)
    comparison = resolve(client_for(args.tracking_uri), run_ids)  # ComparisonError: a usage error (exit 2)
    render = comparison_json if args.as_json else comparison_csv if args.as_csv else comparison_table
    table = render(comparison)
    if args.plot:
        plot_comparison(comparison, args.plot, args.metric or DEFAULT_METRIC, args.x_key)
    print(table, end="")
    if args.out:
        write_text_atomic(Path(args.out), table)
    return 0


def _server(args) -> int:
    from worldpipe.config import paths
    from worldpipe.tracking.server import DEFAULT_PORT, LOCAL_HOST, exec_server, server_command

    extra = [a for a in args.overrides if a != "--"]  # anything after `--` goes to `mlflow server` as is
    # ServerConfigError: a usage error (exit 2)
    command = server_command(args.backend_store_uri or paths.default_tracking_uri(),
                             args.artifacts_destination or paths.layout()["mlartifacts"], args.host or LOCAL_HOST,
                             args.port or DEFAULT_PORT, args.workers, extra)
    if args.print_command:
        print(" ".join(command))
        return 0
    if (args.host or LOCAL_HOST) != LOCAL_HOST:
        print(f"warning: the tracking server listens on {args.host} without authentication", file=sys.stderr)
    exec_server(command)
    return 0
