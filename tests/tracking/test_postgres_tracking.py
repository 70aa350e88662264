"""The smoke pipeline against `worldpipe tracking server` on a real PostgreSQL records what it records in SQLite.

A fresh PostgreSQL cluster (initdb in a temp dir, free port, stopped by PID) backs the server; the same smoke
pipeline runs once against it over HTTP and once on the embedded SQLite file. The training runs must agree on
params (paths aside), metric histories (values of the computation bit for bit), evaluation metrics, tags of the
checkpoint, dataset inputs, the logged model and the artifact tree.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from postgres_support import PostgresCluster, unavailable_reason

from mlflow_support import MlflowServer, run_group
from pipeline_project import seed_datasets
from worldpipe.tracking.evaluation import CLOCK_METRICS as CONTROL_CLOCK_METRICS
from worldpipe.tracking.history import histories
from worldpipe.tracking.records import TIMING_METRICS
from worldpipe.tracking.system_metrics import PREFIX as SYSTEM_PREFIX

# Whole pipelines in the module fixture: well past the default per-test timeout on a busy 2-core machine.
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(2400)]

# Params that name where things are (they differ between the two pipeline directories by construction).
LOCATION_PARAMS = ("run_dir", "data.store", "data.manifest", "checkpoint.dir", "tracking.uri")


def _pipeline(repo: Path, workdir: Path, env: dict, uri: str | None) -> dict:
    cmd = ["snakemake", "-s", str(repo / "Snakefile"), "--directory", str(workdir), "--cores", "2",
           "--configfile", str(repo / "conf/pipeline/smoke.yaml")]
    if uri:  # else the config's default: the embedded SQLite file results/mlflow.db
        cmd += ["--config", f"tracking_uri={uri}"]
    proc = run_group(cmd, env, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return json.loads((workdir / "results/runs/smoke/latest/train_done.json").read_text())  # config-addressed


@pytest.fixture(scope="module")
def both(repo, env_with_venv, tmp_path_factory):
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    cluster = PostgresCluster().start()
    server = None
    try:
        server = MlflowServer(tmp_path_factory.mktemp("pg_server"), backend_uri=cluster.uri).start()
        pg_dir = tmp_path_factory.mktemp("pg_pipeline")
        pg_done = _pipeline(repo, pg_dir, env_with_venv, server.url)
        sqlite_dir = tmp_path_factory.mktemp("sqlite_pipeline")
        seed_datasets(pg_dir, sqlite_dir)  # only the stages from training on run again
        sqlite_uri = f"sqlite:///{sqlite_dir / 'results/mlflow.db'}"
        sqlite_done = _pipeline(repo, sqlite_dir, env_with_venv, None)
        pg = MlflowClient(server.url)
        yield {"pg": (pg, pg_done["mlflow_run_id"], pg_done), "sqlite": (MlflowClient(sqlite_uri),
                                                                      sqlite_done["mlflow_run_id"], sqlite_done),
               "server": server, "cluster": cluster}
    finally:
        if server is not None:
            server.kill()
        cluster.stop()


def test_the_server_stores_runs_in_postgresql(both):
    client, run_id, _ = both["pg"]
    assert client.get_run(run_id).info.status == "FINISHED"
    count = subprocess.run(
        ["runuser", "-u", "postgres", "--", str(both["cluster"].bindir / "psql"), "-h", "127.0.0.1", "-p",
         str(both["cluster"].port), "-d", "mlflow", "-tAc", f"SELECT count(*) FROM runs WHERE run_uuid = '{run_id}'"],
        capture_output=True, text=True, timeout=60)
    assert count.stdout.strip() == "1", count.stderr


def test_params_tags_and_inputs_agree_with_sqlite(both):
    (pg, pg_id, pg_done), (lite, lite_id, lite_done) = both["pg"], both["sqlite"]
    a, b = pg.get_run(pg_id), lite.get_run(lite_id)
    strip = lambda params: {k: v for k, v in params.items() if k not in LOCATION_PARAMS}  # noqa: E731
    assert strip(a.data.params) == strip(b.data.params)
    assert set(a.data.params) == set(b.data.params)
    assert pg_done["digest"] == lite_done["digest"]
    for tag in ("worldpipe.checkpoint.digest", "worldpipe.eval.checkpoint_digest", "worldpipe.dataset_hash",
                "worldpipe.eval.heldout_dataset_hash", "worldpipe.eval.complete"):
        assert a.data.tags[tag] == b.data.tags[tag], tag
    inputs = lambda run: sorted((d.dataset.name, d.dataset.digest) for d in run.inputs.dataset_inputs)  # noqa: E731
    assert inputs(a) == inputs(b) and len(inputs(a)) == 2


def test_metric_histories_agree_with_sqlite(both):
    (pg, pg_id, _), (lite, lite_id, _) = both["pg"], both["sqlite"]
    keep = lambda h: {k: v for k, v in h.items() if not k.startswith(SYSTEM_PREFIX)}  # noqa: E731
    ha, hb = keep(histories(pg, pg_id)), keep(histories(lite, lite_id))
    assert set(ha) == set(hb) and any(k.startswith("eval/") for k in ha)
    for key in ha:
        assert [s for s, _, _ in ha[key]] == [s for s, _, _ in hb[key]], key
        if key not in TIMING_METRICS + CONTROL_CLOCK_METRICS:
            assert [v for *_, v in ha[key]] == [v for *_, v in hb[key]], key


def test_artifacts_and_logged_model_agree_with_sqlite(both):
    (pg, pg_id, _), (lite, lite_id, _) = both["pg"], both["sqlite"]

    def tree(client, run_id, path=None):
        out = set()
        for item in client.list_artifacts(run_id, path):
            out |= tree(client, run_id, item.path) if item.is_dir else {item.path}
        return out

    assert tree(pg, pg_id) == tree(lite, lite_id)
    for client, run_id in ((pg, pg_id), (lite, lite_id)):
        experiment_id = client.get_run(run_id).info.experiment_id
        assert len(client.search_logged_models([experiment_id], filter_string=f"source_run_id = '{run_id}'")) == 1
