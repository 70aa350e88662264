"""`worldpipe tracking ...` (spooled records of a run directory) and `worldpipe compare` (runs side by side)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from worldpipe.paths import COMPLETION_RECORD


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

    compare = sub.add_parser("compare", help="param differences and final metrics of runs side by side")
    compare.add_argument("run_ids", nargs="+", metavar="RUN_ID")
    compare.add_argument("--tracking-uri", help="default: $MLFLOW_TRACKING_URI, else results/mlflow.db")
    compare.set_defaults(handler=_compare)


def _last_open(spool) -> dict:
    opens = [r for r in spool.records() if r["op"] == "open"]
    return opens[-1] if opens else {}


def _sync(args) -> int:
    from worldpipe.atomic import write_text_atomic
    from worldpipe.tracking.delivery import checkpoint_probe, deliver
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
    from worldpipe.tracking.history import client_for, compare_table

    print(compare_table(client_for(args.tracking_uri), args.run_ids))
    return 0
