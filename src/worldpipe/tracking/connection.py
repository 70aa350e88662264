"""Reaching MLflow: which tracking URI, a client that gives up in seconds, the SQLite store made whole, the
experiment found or created, runs found by their tags, the metrics a run lacks. Every room that talks to MLflow
connects through here."""

from __future__ import annotations

import contextlib
import os
import re
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from worldpipe.config.paths import default_tracking_uri
from worldpipe.core.atomic import fsync_dir, makedirs_durably

# A delivery must not stall for minutes on an unreachable server (MLflow's defaults retry 7 times with
# exponential backoff and wait 120 s per request): records are spooled, so fail fast and retry later.
HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                 "MLFLOW_HTTP_REQUEST_TIMEOUT": "20"}
SCRATCH_STORE = ".{name}.creating-{pid}"  # a SQLite store being created, beside where it will appear
# MLflow's package has import cycles that fail ("partially initialized module") when two threads import it at the
# same moment, as the courier's delivery and its system-metrics sampler do at its start: they take turns here.
_IMPORT_LOCK = threading.Lock()


def resolve_tracking_uri(uri: str | None) -> str:
    """Config value, else $MLFLOW_TRACKING_URI, else the embedded SQLite file (conf/paths: tracking_db)."""
    return uri or os.environ.get("MLFLOW_TRACKING_URI") or default_tracking_uri()


def fail_fast_over_http() -> None:
    """Make this process's MLflow HTTP calls give up in seconds on an unreachable server (unless the user set
    the MLflow variables): every caller either spools what it could not deliver or reports it in one line."""
    for key, value in HTTP_DEFAULTS.items():
        os.environ.setdefault(key, value)


def import_mlflow() -> None:
    """Import the MLflow modules delivery and the system-metrics sampler use (a no-op once done)."""
    with _IMPORT_LOCK:
        import mlflow.system_metrics.system_metrics_monitor  # noqa: F401 - imported for the side effect
        import mlflow.tracking  # noqa: F401 - imported for the side effect


def client_for(uri: str | None):
    """:func:`tracking_client` of ``uri`` (resolved like training resolves it), failing fast when the server is
    down."""
    fail_fast_over_http()
    return tracking_client(resolve_tracking_uri(uri))


def tracking_client(uri: str):
    """The delivery's MlflowClient of ``uri``, a SQLite store created whole first. MLflow caches the store per
    URI (for SQLite: the engine and the schema check, seconds on a cold start), so a first call ahead of the
    deliveries takes that off their path."""
    import_mlflow()
    from mlflow.tracking import MlflowClient

    if uri.startswith("sqlite:///"):
        create_sqlite_store(Path(uri.removeprefix("sqlite:///")))
    return MlflowClient(tracking_uri=uri)


def create_sqlite_store(path: Path) -> None:
    """Make the SQLite store at ``path`` if there is none, so that it appears whole.

    MLflow creates a store's tables one by one, and a process killed half-way leaves a file it can no longer
    open ("table ... already exists"). Here the tables are made in a scratch file beside ``path``, which is then
    linked into place: a kill leaves only the scratch file (removed by the next creator), and of two processes
    creating the same store at once (two training jobs of a pipeline) the second uses the first's.
    """
    if path.exists():
        return
    import psutil
    from mlflow.tracking import MlflowClient

    makedirs_durably(path.parent)  # the store is only as durable as the names leading to it
    # A dead creator's scratch file, and SQLite's rollback journal of it
    scratch_name = re.compile(re.escape(SCRATCH_STORE.format(name=path.name, pid="")) + r"(\d+)(-journal)?")
    for stale in path.parent.iterdir():
        found = scratch_name.fullmatch(stale.name)
        if found and not psutil.pid_exists(int(found[1])):
            stale.unlink(missing_ok=True)
    scratch = path.with_name(SCRATCH_STORE.format(name=path.name, pid=os.getpid()))
    scratch.unlink(missing_ok=True)
    try:
        MlflowClient(tracking_uri=f"sqlite:///{scratch}").search_experiments(max_results=1)  # creates the tables
        with contextlib.suppress(FileExistsError):  # created meanwhile by another process: that one is used
            os.link(scratch, path)
        fsync_dir(path.parent)
    finally:
        scratch.unlink(missing_ok=True)


def unlogged(client, run_id: str, metrics: list, identity: Callable[[Any], tuple]) -> list:
    """The ``metrics`` run ``run_id`` does not hold yet (none with the same ``identity``): logging again what an
    interrupted or repeated attempt logged adds nothing."""
    held = {identity(m) for key in {m.key for m in metrics} for m in client.get_metric_history(run_id, key)}
    return [m for m in metrics if identity(m) not in held]


def tag_filter(tags: Mapping[str, str]) -> str:
    """The search filter of the runs that carry every one of ``tags``."""
    return " AND ".join(f"tags.`{k}` = '{v}'" for k, v in tags.items())


def ensure_experiment(client, name: str) -> str:
    """The id of experiment ``name``, restored if deleted, created if missing (by whichever writer comes first:
    training, a sweep's or a loop's parent run); with a SQLite store its artifacts go beside the database
    (MLflow's default is ./mlruns of the current directory)."""
    from mlflow.exceptions import MlflowException

    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        if experiment.lifecycle_stage == "deleted":
            client.restore_experiment(experiment.experiment_id)
        return experiment.experiment_id
    uri, location = str(client.tracking_uri), None
    if uri.startswith("sqlite:///"):
        slug = re.sub(r"[^A-Za-z0-9._-]+", "_", name)
        location = (Path(uri.removeprefix("sqlite:///")).parent / "mlartifacts" / slug).as_uri()
    try:
        return client.create_experiment(name, artifact_location=location)
    except MlflowException:  # created concurrently (or by a create whose answer was lost)
        experiment = client.get_experiment_by_name(name)
        if experiment is None:
            raise
        return experiment.experiment_id
