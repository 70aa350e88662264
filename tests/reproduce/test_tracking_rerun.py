"""Rerun checks without training: code drift, the verdict of a comparison, a lost server that comes back."""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import pytest
from mlflow.entities import Metric
from mlflow.tracking import MlflowClient

from worldpipe.core import provenance as ident
from worldpipe.reproduce.drift import RerunError, check_code
from worldpipe.reproduce.rerun import compare_runs
from worldpipe.tracking.history import RecordedRun
from worldpipe.tracking.recorder import RunRecorder


@pytest.fixture(scope="module")
def sqlite_uri(tmp_path_factory) -> str:
    uri = f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"
    MlflowClient(uri).search_experiments()
    return uri


def _recorded(**code) -> RecordedRun:
    current = ident.code_version()
    identity = {"code_version": {**current, **code}, "versions": ident.package_versions(),
                "lock_hash": ident.lock_hash()}
    tags = {}
    if identity["code_version"]["git_dirty"]:
        import hashlib

        tags["worldpipe.git_diff_sha256"] = hashlib.sha256(ident.git_diff().encode()).hexdigest()
    run = SimpleNamespace(data=SimpleNamespace(tags=tags))
    return RecordedRun("abc", run, {}, identity, None)


def test_same_code_passes_and_drift_is_refused_unless_allowed():
    assert check_code(_recorded(), allow_drift=False) is None
    drifted = _recorded(git_sha="0" * 40)
    with pytest.raises(RerunError, match="--allow-code-drift") as err:
        check_code(drifted, allow_drift=False)
    assert "git SHA: recorded 0000" in str(err.value)
    assert "git SHA" in check_code(drifted, allow_drift=True)


def _run_with(client, experiment_id, values, digest):
    run_id = client.create_run(experiment_id).info.run_id
    client.log_batch(run_id, metrics=[Metric("loss/total", v, 1000 + s, s) for s, v in values]
                     + [Metric("step_time_s", 0.1 * s, 1000 + s, s) for s, _ in values])
    client.set_tag(run_id, "worldpipe.checkpoint.digest", digest)
    return run_id


def test_comparison_verdicts(sqlite_uri):
    client = MlflowClient(sqlite_uri)
    experiment_id = client.create_experiment("verdicts")
    a = _run_with(client, experiment_id, [(5, 1.0), (10, 0.5)], "d1")
    same = _run_with(client, experiment_id, [(5, 1.0), (10, 0.5)], "d1")
    off = _run_with(client, experiment_id, [(5, 1.0), (10, 0.5000001)], "d2")
    other_digest = _run_with(client, experiment_id, [(5, 1.0), (10, 0.5)], "d3")
    assert compare_runs(client, a, same).identical
    result = compare_runs(client, a, off)
    assert not result.identical and result.difference[:2] == (10, "loss/total")
    assert "first at step 10, metric loss/total" in result.message
    digest_only = compare_runs(client, a, other_digest)
    assert not digest_only.identical and "digest" in digest_only.message


@pytest.mark.integration
def test_the_courier_replays_on_its_own_when_the_server_answers_again(tmp_path, caplog):
    from integration.mlflow_support import MlflowServer

    server = MlflowServer(tmp_path / "server")  # not started yet: nothing listens on its port
    recorder = RunRecorder(True, server.url, "recovery", run_dir=tmp_path / "run", retry_s=0.5)
    try:
        with caplog.at_level(logging.WARNING, logger="worldpipe.tracking"):
            recorder.start(None, "recovery", {})
            recorder.add_metrics(1, {"x": 1.0}, 1)
            recorder.stage(1)
            recorder.commit(1)  # returns at once: delivery is the courier's job
            assert recorder.await_run_id() is None and "unreachable" in caplog.text
            server.start()  # the server is back; nobody runs `worldpipe tracking sync`
            deadline = time.monotonic() + 120
            while "reachable again" not in caplog.text:
                assert time.monotonic() < deadline, "the courier never replayed the spool"
                time.sleep(0.1)
        run_id = recorder.run_id
        assert run_id is not None
        recorder.add_metrics(2, {"x": 2.0}, 2)
        recorder.stage(2)
        recorder.commit(2)
        recorder.end()
        client = MlflowClient(server.url)
        assert sorted((m.step, m.value) for m in client.get_metric_history(run_id, "x")) == [(1, 1.0), (2, 2.0)]
        assert client.get_run(run_id).info.status == "FINISHED"
    finally:
        recorder.abandon()  # nothing left to stop after end(); the courier, if the test failed before it
        server.kill()
