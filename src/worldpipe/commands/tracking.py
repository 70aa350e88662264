"""`worldpipe tracking ...` (spooled records of a run directory) and `worldpipe compare` (runs side by side)."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path

from worldpipe.config.paths import COMPLETION_RECORD

log = logging.getLogger("worldpipe.tracking")


def register(sub) -> None:
    tracking = sub.add_parser("tracking", help="MLflow records of a run directory").add_subparsers(
        dest="tracking_command", required=True)
    sync = tracking.add_parser("sync", help="replay records spooled while tracking was unreachable (idempotent)")
    sync.add_argument("run_dir", help="run directory (holding tracking/journal.jsonl)")
    sync.add_argument("--tracking-uri", help="default: the URI the run recorded to")
    sync.add_argument("--mark-killed", action="store_true",
                      help="if the training process died without ending the run, record it as KILLED")
    sync.set_defaults(handler=_sync)
    status = tracking.add_parser("status", help="run id, acknowledged and pending records")
    status.add_argument("run_dir")
    status.set_defaults(handler=_status)

    server = tracking.add_parser("server", help="run an MLflow tracking server (PostgreSQL backend for clusters)")
    server.add_argument("--backend-store-uri", default=None,
                        help="postgresql://USER:PASSWORD@HOST:PORT/DB (default: sqlite:///results/mlflow.db)")
    server.add_argument("--artifacts-destination", default=None,
                        help="artifact root, on the shared filesystem (default: results/mlartifacts)")
    server.add_argument("--host", default=None, help="address to bind (default 127.0.0.1: this machine only; "
                                                     "0.0.0.0 opens it to the network, without authentication)")
    server.add_argument("--port", type=int, default=None, help="default 5000")
    server.add_argument("--workers", type=int, default=1)
    server.add_argument("--print-command", action="store_true", help="print the mlflow command instead")
    server.set_defaults(handler=_server, accepts_overrides=True)

    compare = sub.add_parser("compare", help="differing params and evaluation metrics of runs (or of a sweep) "
                                             "side by side; optionally a metric-vs-swept-key plot")
    compare.add_argument("run_ids", nargs="+", metavar="RUN",
                         help="run id, sweep parent run id (all its runs), or a JSON file naming one "
                              "(train_done.json, a sweep's parent.json)")
    compare.add_argument("--tracking-uri", help="default: $MLFLOW_TRACKING_URI, else results/mlflow.db")
    compare.add_argument("--plot", help="PNG to write: the metric against the first swept key, seeds as error bars")
    compare.add_argument("--metric", default=None, help="metric of the plot (default eval/one_step_ratio)")
    compare.add_argument("--x", dest="x_key", help="param on the plot's x axis (default: the first swept key)")
    compare.add_argument("--out", help="also write the table to this file (atomically)")
    compare.set_defaults(handler=_compare)


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
        print(f"error: {spool.journal} does not exist (no records spooled in {args.run_dir})", file=sys.stderr)
        return 2
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
        comparison_table,
        plot_comparison,
        resolve,
    )
    from worldpipe.tracking.history import client_for

    try:
        comparison = resolve(client_for(args.tracking_uri), args.run_ids)
        table = comparison_table(comparison)
        if args.plot:
            plot_comparison(comparison, args.plot, args.metric or DEFAULT_METRIC, args.x_key)
    except ComparisonError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(table, end="")
    if args.out:
        write_text_atomic(Path(args.out), table)
    return 0


def _server(args) -> int:
    from worldpipe.config import paths
    from worldpipe.tracking.server import (
        DEFAULT_PORT,
        LOCAL_HOST,
        ServerConfigError,
        exec_server,
        server_command,
    )

    extra = [a for a in args.overrides if a != "--"]  # anything after `--` goes to `mlflow server` as is
    try:
        command = server_command(args.backend_store_uri or paths.default_tracking_uri(),
                                 args.artifacts_destination or paths.layout()["mlartifacts"], args.host or LOCAL_HOST,
                                 args.port or DEFAULT_PORT, args.workers, extra)
    except ServerConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.print_command:
        print(" ".join(command))
        return 0
    if (args.host or LOCAL_HOST) != LOCAL_HOST:
        print(f"warning: the tracking server listens on {args.host} without authentication", file=sys.stderr)
    exec_server(command)
    return 0
