"""The MLflow run started by the delivery thread while training goes on: the records reach one run, in order,
nothing lost or duplicated — with the server up, down, or never reached before the process died. A real MLflow
SQLite backend; an unreachable server is a 127.0.0.1 port nothing listens on."""

from __future__ import annotations

import logging
import threading
import time

from mlflow.tracking import MlflowClient

from worldpipe.cli import main as cli_main
from worldpipe.tracking.delivery import RECORD_KEY_TAG
from worldpipe.tracking.history import duplicate_steps, histories
from worldpipe.tracking.recorder import RunRecorder
from worldpipe.tracking.spool import Spool
from worldpipe.tracking.system_metrics import PREFIX as SYSTEM_PREFIX
from worldpipe.tracking.system_metrics import SystemMetricsSampler


def background(uri: str, experiment: str, run_dir, **kwargs) -> RunRecorder:
    return RunRecorder(True, uri, experiment, run_dir=run_dir, background_start=True, **kwargs)


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


def test_background_start_records_everything_in_one_run(tmp_path, sqlite_uri):
    recorder = background(sqlite_uri, "bg-one-run", tmp_path)
    recorder.start(None, "bg", {"worldpipe.seed": "0"})
    recorder.log_params({"trainer.steps": 40, "seed": 0})
    train(recorder, range(1, 41))
    run_id = recorder.await_run_id()
    assert run_id is not None and recorder.run_id == run_id
    recorder.end()

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
    assert not Spool(tmp_path).pending()


def test_a_segment_ended_at_once_still_gets_its_run_and_a_system_sample(
        tmp_path, sqlite_uri):
    recorder = background(sqlite_uri, "bg-short", tmp_path, system_metrics_s=60.0)
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
    sampler = SystemMetricsSampler(0.05, sqlite_uri).start()
    deadline = time.monotonic() + 60
    while sampler.points < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    client = MlflowClient(sqlite_uri)
    run_id = client.create_run(client.create_experiment("early-samples")).info.run_id
    sampler.attach(run_id, resume=False)
    while sampler.points < 8 and time.monotonic() < deadline:
        time.sleep(0.05)
    sampler.stop()
    memory = client.get_metric_history(run_id, SYSTEM_PREFIX + "system_memory_usage_megabytes")
    assert len(memory) >= 9 and sorted(m.step for m in memory) == list(range(len(memory))), len(memory)
    assert all(m.value > 0 for m in memory)


def system_metric_samplers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "worldpipe-system-metrics"]


def test_unreachable_server_at_a_background_start_warns_once_and_sync_replays(tmp_path, dead_uri, sqlite_uri,
                                                                              caplog):
    with caplog.at_level(logging.WARNING, logger="worldpipe.tracking"):
        recorder = background(dead_uri, "bg-offline", tmp_path, system_metrics_s=0.05)
        recorder.start(None, "offline", {})
        recorder.log_params({"seed": 0})
        assert recorder.await_run_id() is None  # tried: the thread met the dead server
        train(recorder, range(1, 21))
        recorder.end()
    assert not system_metric_samplers()  # no run to log to: the sampler stopped with the segment
    unreachable = [r for r in caplog.records if "is unreachable" in r.getMessage()]
    assert len(unreachable) == 1 and "worldpipe tracking sync" in unreachable[0].getMessage()
    assert Spool(tmp_path).pending()

    assert cli_main(["tracking", "sync", str(tmp_path), "--tracking-uri", sqlite_uri]) == 0
    client = MlflowClient(sqlite_uri)
    [run] = runs_of(client, "bg-offline")
    assert run.info.status == "FINISHED" and run.data.params == {"seed": "0"}
    history = histories(client, run.info.run_id)
    assert [s for s, _, _ in history["lr"]] == list(range(1, 21)) and not duplicate_steps(history)


def test_killed_before_the_run_start_finished_resumes_into_one_run(tmp_path, dead_uri, sqlite_uri):
    first = background(dead_uri, "bg-killed", tmp_path)
    first.start(None, "killed", {})
    first.log_params({"seed": 0})
    train(first, range(1, 24))  # checkpoints 10 and 20 durable; 21..23 only in memory
    first.await_run_id()
    first._stop_thread()  # the process died: no delivery thread, no live writer, the run never created
    first.spool.release_active()
    assert Spool(tmp_path).state()["run_id"] is None

    resumed = background(sqlite_uri, "bg-killed", tmp_path)
    resumed.start(None, "killed", {}, resume_step=20)  # the checkpoint held no run id
    train(resumed, range(21, 41))
    run_id = resumed.await_run_id()
    resumed.end()
    client = MlflowClient(sqlite_uri)
    assert [r.info.run_id for r in runs_of(client, "bg-killed")] == [run_id]
    history = histories(client, run_id)
    assert [s for s, _, _ in history["lr"]] == list(range(1, 41)) and not duplicate_steps(history)
    assert client.get_run(run_id).data.params == {"seed": "0"}
    assert len(client.list_artifacts(run_id, "checkpoints")) == 4
