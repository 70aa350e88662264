"""Rerun checks without training: code drift, the verdict of a comparison."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from mlflow.entities import Metric
from mlflow.tracking import MlflowClient

from worldpipe.core import provenance as ident
from worldpipe.reproduce.drift import RerunError, check_code
from worldpipe.reproduce.rerun import compare_runs
from worldpipe.tracking.history import RecordedRun


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
