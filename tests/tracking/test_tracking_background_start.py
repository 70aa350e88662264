"""The MLflow run started by the courier (the recorder's child process, as in training) while training goes on:
the records reach one run, in order, nothing lost or duplicated, and the courier is reaped by its PID at the end.
A real MLflow SQLite backend. (A server that is down, or never reached before the process died: the spool's
tests.)"""

from __future__ import annotations

import json
import os
import sys
import time

import psutil
from mlflow.tracking import MlflowClient

from processes import wait_gone
from worldpipe.tracking.courier import RECORD_NAME
from worldpipe.tracking.delivery import RECORD_KEY_TAG
from worldpipe.tracking.history import duplicate_steps, histories
from worldpipe.tracking.recorder import RunRecorder
from worldpipe.tracking.spool import Spool
from worldpipe.tracking.system_metrics import PREFIX as SYSTEM_PREFIX
from worldpipe.tracking.system_metrics import SystemMetricsSampler


def train(recorder: RunRecorder, steps, every: int = 10) -> None:
    """The training loop's calls: metrics every step, stage/commit (with artifacts and tags) every `every`."""
    for step in steps:
        recorder.add_metrics(step, {"loss/total": 1.0 / step, "lr": 1e-3 * step}, step)
        if step % every == 0:
            recorder.stage(step)
            recorder.commit(step, {f"checkpoints/step-{step:06d}/digest.json": b'{"step": %d}' % step},
                            tags={"worldpipe.checkpoint.step": str(step)})


def runs_of(client: MlflowClient, experiment: str) -> list:
    return client.search_runs([client.get_experiment_by_name(experiment).experiment_id])


def test_background_start_records_everything_in_one_run_and_the_courier_is_reaped(tmp_path, sqlite_uri):
    opened = []
    torch_loaded = "torch" in sys.modules  # depends on what else this worker ran
    recorder = RunRecorder(True, sqlite_uri, "bg-one-run", run_dir=tmp_path, system_metrics_s=0.2,
                           on_opened=lambda: opened.append(True))
    recorder.start(None, "bg", {"worldpipe.seed": "0"})
    pid = recorder.courier_pid
    record = json.loads((tmp_path / "tracking" / RECORD_NAME).read_text())
    assert record == {"pid": pid, "parent_pid": os.getpid(), "before_torch": not torch_loaded}
    assert psutil.Process(pid).ppid() == os.getpid() and os.getpgid(pid) == os.getpgid(0)  # ours, in our group
    recorder.log_params({"trainer.steps": 40, "seed": 0})
    train(recorder, range(1, 41))
    run_id = recorder.await_run_id()
    assert run_id is not None and recorder.run_id == run_id
    recorder.end()
    assert opened == [True]  # reported once, after the start was tried (await_run_id may return first)
    assert not wait_gone({pid}, timeout=0) and not (tmp_path / "tracking" / RECORD_NAME).exists()

    client = MlflowClient(sqlite_uri)
    assert [r.info.run_id for r in runs_of(client, "bg-one-run")] == [run_id]
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "bg"
    assert run.data.params == {"trainer.steps": "40", "seed": "0"}
    assert run.data.tags["worldpipe.seed"] == "0" and run.data.tags["worldpipe.checkpoint.step"] == "40"
    assert run.data.tags[RECORD_KEY_TAG] == Spool(tmp_path).state()["record_key"]
    history = histories(client, run_id)
    assert [s for s, _, _ in history["lr"]] == list(range(1, 41)) and not duplicate_steps(history)
    assert len(client.list_artifacts(run_id, "checkpoints")) == 4
    assert any(key.startswith(SYSTEM_PREFIX) for key in run.data.metrics), sorted(run.data.metrics)
    assert not Spool(tmp_path).pending()


def test_a_segment_ended_at_once_still_gets_its_run_and_a_system_sample(
        tmp_path, sqlite_uri):
    recorder = RunRecorder(True, sqlite_uri, "bg-short", run_dir=tmp_path, system_metrics_s=60.0)
    recorder.start(None, "short", {})
    train(recorder, range(1, 11))
    recorder.end()  # at once: waits for the start, then takes the segment's one system sample
    run_id = Spool(tmp_path).state()["run_id"]
    client = MlflowClient(sqlite_uri)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert any(key.startswith(SYSTEM_PREFIX) for key in run.data.metrics), sorted(run.data.metrics)
    assert [s for s, _, _ in histories(client, run_id, ["lr"])["lr"]] == list(range(1, 11))


def test_host_samples_taken_before_the_run_existed_are_logged_first(sqlite_uri):
    # The background start creates the run seconds into training, about as long as a short run lasts: what the
    # host did meanwhile must reach the run, numbered before what is sampled after it exists.
    run: dict[str, str] = {}
    sampler = SystemMetricsSampler(0.05, sqlite_uri, run_id=lambda: run.get("id")).start()
    deadline = time.monotonic() + 60
    while sampler.points < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    client = MlflowClient(sqlite_uri)
    run_id = client.create_run(client.create_experiment("early-samples")).info.run_id
    run["id"] = run_id  # the run exists: the sampler logs what it kept at its next point
    while sampler.points < 8 and time.monotonic() < deadline:
        time.sleep(0.05)
    sampler.stop()
    memory = client.get_metric_history(run_id, SYSTEM_PREFIX + "system_memory_usage_megabytes")
    assert len(memory) >= 9 and sorted(m.step for m in memory) == list(range(len(memory))), len(memory)
    assert all(m.value > 0 for m in memory)
