"""Processes that log the same dataset to one MLflow experiment at once all succeed (the pipeline's evaluations of
a sweep's points run in parallel and each logs the held-out dataset).

MLflow's SQL store looks a dataset up and then inserts it; of two processes in that window, the second insert
fails on the unique key. ``log_datasets`` tries again, and the lookup then finds the row. Real processes on a real
SQLite store, released together by a barrier; CI stop 36's pipeline failed on this race.
"""

from __future__ import annotations

import json
import multiprocessing

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # six processes importing MLflow: ~45 s

PROCESSES = 6


def _log(uri: str, experiment_id: str, manifest: dict, store: str, barrier, errors) -> None:
    from mlflow.tracking import MlflowClient

    from worldpipe.tracking.datasets import EVALUATION, DatasetRecord, log_datasets

    client = MlflowClient(uri)
    run_id = client.create_run(experiment_id).info.run_id
    barrier.wait(timeout=60)
    try:
        log_datasets(client, run_id, [DatasetRecord.from_manifest(manifest, store, EVALUATION)])
    except Exception as err:  # noqa: BLE001 - reported to the test
        errors.put(f"{type(err).__name__}: {str(err)[:300]}")


def test_parallel_processes_log_one_dataset_without_a_unique_key_failure(tmp_path, smoke_dataset):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    experiment_id = MlflowClient(uri).create_experiment("race")
    manifest = json.loads(smoke_dataset[1].read_text())
    context = multiprocessing.get_context("spawn")
    barrier, errors = context.Barrier(PROCESSES), context.Queue()
    procs = [context.Process(target=_log, args=(uri, experiment_id, manifest, str(smoke_dataset[0]), barrier, errors))
             for _ in range(PROCESSES)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=180)
    assert all(proc.exitcode == 0 for proc in procs), [proc.exitcode for proc in procs]
    found = []
    while not errors.empty():
        found.append(errors.get())
    assert not found, found
    runs = MlflowClient(uri).search_runs([experiment_id])
    assert len(runs) == PROCESSES and all(len(r.inputs.dataset_inputs) == 1 for r in runs)
