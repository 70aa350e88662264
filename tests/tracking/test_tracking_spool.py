"""The durable spool and its replay into a real MLflow SQLite backend: nothing lost, nothing duplicated.

Every recorder delivers as training does, through its courier (a real child process); an unreachable server is a
127.0.0.1 port nothing listens on."""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from processes import wait_gone
from worldpipe.cli import main as cli_main
from worldpipe.tracking import spool as spool_module
from worldpipe.tracking.delivery import RECORD_KEY_TAG, DeliveryLoop, deliver, metric_fate
from worldpipe.tracking.history import duplicate_steps, histories
from worldpipe.tracking.recorder import RunRecorder
from worldpipe.tracking.records import MAX_PARAM_VALUE_LENGTH
from worldpipe.tracking.spool import Spool


def _metrics(step: int, offset: float = 0.0) -> dict[str, float]:
    return {"loss/total": 1.0 / step + offset, "lr": 1e-3 * step}


def _simulate(recorder: RunRecorder, steps, every: int, crash_after_stage: int | None = None, ts: int = 0):
    """Training-loop order: add metrics each step; at each checkpoint stage, (publish), commit."""
    for step in steps:
        recorder.add_metrics(step, _metrics(step), ts + step)
        if step % every == 0:
            recorder.stage(step)
            if step == crash_after_stage:
                return  # died after journaling, before the checkpoint was published
            recorder.commit(step, {f"checkpoints/step-{step:06d}/digest.json": b'{"step": %d}' % step})


def test_a_checkpoints_records_are_one_journal_write_and_every_file_arrives_whole(tmp_path, sqlite_uri,
                                                                                  monkeypatch):
    run_dir = tmp_path / "run"
    recorder = RunRecorder(True, sqlite_uri, "spool-inline", run_dir=run_dir)
    recorder.start(None, "inline", {})
    spool = Spool(run_dir)
    files = {"checkpoints/step-000010/manifest.json": b'{"step": 10}',          # small text: in the journal line
             "checkpoints/step-000010/rng/rank0.json": b'{"torch": "abc"}',
             "checkpoints/step-000010/big.txt": b"x" * (1 << 17),               # large: a blob file
             "checkpoints/step-000010/state.bin": bytes(range(256)) * 4}       # binary: a blob file
    before = spool.journal.stat().st_size
    writes = []
    original = spool_module.append_durably
    monkeypatch.setattr(spool_module, "append_durably", lambda path, data: (writes.append(data), original(path, data))[1])
    recorder.commit(10, files, {"worldpipe.checkpoint.step": "10"})  # the real write, watched
    assert len(writes) == 1 and spool.journal.stat().st_size == before + len(writes[0])
    ops = [json.loads(line)["op"] for line in writes[0].decode().splitlines()]
    assert ops == ["commit", "artifacts", "artifacts", "tags"]  # checkpoints/step-000010 and its rng/ folder
    recorder.end("FINISHED")
    client = MlflowClient(sqlite_uri)
    run_id = spool.state()["run_id"]
    for path, data in files.items():
        assert Path(client.download_artifacts(run_id, path, str(tmp_path / "down"))).read_bytes() == data, path
    assert client.get_run(run_id).data.tags["worldpipe.checkpoint.step"] == "10"


def test_journal_sequence_and_torn_tail(tmp_path):
    spool = Spool(tmp_path)
    assert [spool.append("tags", tags={"a": str(i)}) for i in range(3)] == [1, 2, 3]
    with open(spool.journal, "ab") as handle:
        handle.write(b'{"seq": 4, "op": "ta')  # a write torn by a crash
    assert [r["seq"] for r in spool.records()] == [1, 2, 3]
    assert spool.append("tags", tags={"b": "1"}) == 4
    assert [r["seq"] for r in spool.records()] == [1, 2, 3, 4]
    assert spool.journal.read_bytes().endswith(b"\n")


def test_metric_fate_rules():
    staged = {"op": "metrics", "gate": 20}
    assert metric_fate([staged, {"op": "commit", "step": 20}], 0, None) == "deliver"
    assert metric_fate([staged, {"op": "open", "resume_step": 20}], 0, None) == "deliver"
    assert metric_fate([staged, {"op": "open", "resume_step": 10}], 0, None) == "void"
    assert metric_fate([staged, {"op": "tags"}], 0, None) is None
    assert metric_fate([staged], 0, lambda gate: gate <= 30) == "deliver"
    assert metric_fate([staged], 0, lambda gate: False) == "void"


def test_unreachable_at_start_spools_everything_and_sync_replays_it_once(tmp_path, dead_uri, sqlite_uri, caplog,
                                                                         capsys):
    run_dir = tmp_path / "run"
    with caplog.at_level(logging.WARNING, logger="worldpipe.tracking"):
        recorder = RunRecorder(True, dead_uri, "spool-offline", run_dir=run_dir)
        assert recorder.start(None, "offline", {"worldpipe.seed": "0"}, checkpoint_dir=str(run_dir / "ckpt")) is None
        assert recorder.await_run_id() is None  # tried: the courier met the dead server
        long = "z" * (MAX_PARAM_VALUE_LENGTH + 10)
        recorder.log_params({"trainer.steps": 40, "model.name": "rssm", "notes": long})
        _simulate(recorder, range(1, 41), every=10)
        recorder.end("FINISHED")
    # The courier's warning, logged in this process under the same logger, once for the whole outage.
    unreachable = [r for r in caplog.records if "is unreachable" in r.getMessage()]
    assert len(unreachable) == 1 and "worldpipe tracking sync" in unreachable[0].getMessage()
    assert unreachable[0].name == "worldpipe.tracking"
    assert any("still spooled" in r.getMessage() for r in caplog.records)
    assert recorder.run_id is None and len(Spool(run_dir).pending()) > 10
    assert cli_main(["tracking", "status", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert f"pending: {len(Spool(run_dir).pending())}" in out and "open" in out
    assert json.loads((run_dir / "tracking" / "state.json").read_text())["acked"] == 0
    unacknowledged = tmp_path / "unacknowledged"
    shutil.copytree(run_dir / "tracking", unacknowledged)

    assert cli_main(["tracking", "sync", str(run_dir), "--tracking-uri", sqlite_uri]) == 0
    state = Spool(run_dir).state()
    client = MlflowClient(sqlite_uri)
    run = client.get_run(state["run_id"])
    assert run.info.status == "FINISHED" and run.info.run_name == "offline"
    assert run.data.params["trainer.steps"] == "40" and run.data.params["notes"].startswith("<artifact:")
    local = client.download_artifacts(run.info.run_id, "params_overflow/notes.txt", str(tmp_path))
    assert Path(local).read_text() == long
    history = histories(client, run.info.run_id)
    assert [s for s, _, _ in history["loss/total"]] == list(range(1, 41))
    assert not duplicate_steps(history)
    assert len(client.list_artifacts(run.info.run_id, "checkpoints")) == 4
    blobs = run_dir / "tracking" / "blobs"
    assert not blobs.exists() or not list(blobs.iterdir())  # uploaded blobs are dropped
    # A second sync has nothing to do and changes nothing.
    assert cli_main(["tracking", "sync", str(run_dir), "--tracking-uri", sqlite_uri]) == 0
    assert histories(client, run.info.run_id) == history
    # The delivering process died before it wrote any acknowledgement: everything is replayed, found by its
    # record key (not created again), and nothing is duplicated.
    shutil.rmtree(run_dir / "tracking")
    shutil.copytree(unacknowledged, run_dir / "tracking")
    again = deliver(Spool(run_dir), sqlite_uri)
    assert again.error is None and again.pending == 0 and again.run_id == run.info.run_id
    assert len(client.search_runs([run.info.experiment_id])) == 1
    assert client.get_run(run.info.run_id).data.tags[RECORD_KEY_TAG] == Spool(run_dir).state()["record_key"]
    assert histories(client, run.info.run_id) == history


def test_resumed_history_equals_an_uninterrupted_one_and_changed_params_become_tags(tmp_path, sqlite_uri):
    client = MlflowClient(sqlite_uri)
    straight = RunRecorder(True, sqlite_uri, "spool-resume", run_dir=tmp_path / "straight")
    straight.start(None, "straight", {})
    _simulate(straight, range(1, 41), every=10)
    straight.end()

    crashed = RunRecorder(True, sqlite_uri, "spool-resume", run_dir=tmp_path / "crashed")
    crashed.start(None, "crashed", {})
    crashed.log_params({"trainer.steps": 40, "seed": 0})
    run_id = crashed.await_run_id()
    # Steps 21..30 are staged but checkpoint 30 never became durable; 31..33 were only in memory.
    _simulate(crashed, range(1, 34), every=10, crash_after_stage=30)
    courier = crashed.courier_pid
    crashed.abandon()  # the process died: its courier's control pipe closed, no live writer
    assert not wait_gone({courier}), "the courier outlived its abandoned segment"
    resumed = RunRecorder(True, sqlite_uri, "spool-resume", run_dir=tmp_path / "crashed")
    assert resumed.start(run_id, "crashed", {}, resume_step=20) == run_id
    resumed.log_params({"trainer.steps": 80, "seed": 0, "new.key": "x"})  # changed on resume: MLflow keeps a param
    _simulate(resumed, range(21, 41), every=10, ts=1000)  # recomputed: same values, later timestamps
    resumed.end()

    a, b = histories(client, straight.run_id), histories(client, run_id)
    assert {k: [(s, v) for s, _, v in p] for k, p in a.items()} == {k: [(s, v) for s, _, v in p] for k, p in b.items()}
    assert not duplicate_steps(b)
    assert all(ts > 1000 for s, ts, _ in b["lr"] if s > 20)  # the recomputed values, not the staged ones
    run = client.get_run(run_id)
    assert run.data.params == {"trainer.steps": "40", "seed": "0", "new.key": "x"}
    assert run.data.tags["worldpipe.changed.trainer.steps"] == "80"  # the latest value, as a tag
    assert "worldpipe.changed.seed" not in run.data.tags


@pytest.mark.parametrize("published", [True, False])
def test_sync_decides_a_dead_writers_staged_metrics_by_its_checkpoints(tmp_path, dead_uri, sqlite_uri, published):
    from checkpoint_states import example_state
    from worldpipe.checkpoint import CheckpointManager

    run_dir, ckpt_dir = tmp_path / "run", tmp_path / "run" / "checkpoints"
    recorder = RunRecorder(True, dead_uri, f"spool-dead-writer-{published}", run_dir=run_dir)
    recorder.start(None, "dead", {}, checkpoint_dir=str(ckpt_dir))
    for step in range(1, 11):
        recorder.add_metrics(step, _metrics(step), step)
    recorder.stage(10)
    if published:  # the checkpoint became durable, the process died before journaling the commit
        CheckpointManager(str(ckpt_dir)).save(10, example_state())
    recorder.abandon()

    assert cli_main(["tracking", "sync", str(run_dir), "--tracking-uri", sqlite_uri, "--mark-killed"]) == 0
    run_id = Spool(run_dir).state()["run_id"]
    client = MlflowClient(sqlite_uri)
    steps = [s for s, _, _ in histories(client, run_id).get("lr", [])]
    assert steps == (list(range(1, 11)) if published else [])
    assert client.get_run(run_id).info.status == "KILLED"


def test_next_successful_start_replays_what_an_offline_segment_spooled(tmp_path, dead_uri, sqlite_uri):
    offline = RunRecorder(True, dead_uri, "spool-next-start", run_dir=tmp_path)
    offline.start(None, "segments", {})
    offline.log_params({"seed": 0})
    _simulate(offline, range(1, 24), every=10)  # checkpoints 10 and 20 durable; 21..23 only in memory
    assert offline.await_run_id() is None
    offline.abandon()  # preempted/crashed without reaching the server: the run was never created
    assert Spool(tmp_path).state()["run_id"] is None

    online = RunRecorder(True, sqlite_uri, "spool-next-start", run_dir=tmp_path)
    online.start(None, "segments", {}, resume_step=20)  # the checkpoint held no run id
    _simulate(online, range(21, 41), every=10)
    run_id = online.await_run_id()
    assert run_id is not None
    online.end()
    client = MlflowClient(sqlite_uri)
    experiment = client.get_experiment_by_name("spool-next-start")
    assert [r.info.run_id for r in client.search_runs([experiment.experiment_id])] == [run_id]
    history = histories(client, run_id)
    assert [s for s, _, _ in history["lr"]] == list(range(1, 41)) and not duplicate_steps(history)
    assert client.get_run(run_id).data.params == {"seed": "0"}
    assert len(client.list_artifacts(run_id, "checkpoints")) == 4


def test_the_run_start_is_reported_once_its_open_record_is_acknowledged_not_after_the_batch(tmp_path, sqlite_uri):
    # The trainer's first checkpoint waits for this report; the first batch also holds every config param.
    spool = Spool(tmp_path / "run")
    open_seq = spool.append("open", experiment="spool-early-start", run_name="early", tags={}, reopen_run_id=None,
                            record_key=spool.record_key(), resume_step=0, checkpoint_dir=None, uri=sqlite_uri)
    for batch in range(3):
        spool.append("params", params={f"key{batch}.{i}": i for i in range(10)})
        spool.append("tags", tags={f"tag{batch}": "x"})
    acked_when = {}

    def tried() -> None:
        acked_when["tried"] = spool.state()["acked"]

    def opened() -> None:
        acked_when["opened"] = (spool.state()["acked"], spool.state()["run_id"])

    loop = DeliveryLoop(spool, sqlite_uri, on_tried=tried, on_opened=opened)
    loop.begin(open_seq, resume=False, system_metrics_s=0.0, system_metrics_samples=1)
    report = loop.deliver_now()
    assert report.delivered == 7 and not report.pending
    assert acked_when == {"tried": open_seq, "opened": (open_seq, report.run_id)}


def test_the_courier_replays_on_its_own_once_the_store_answers_again(tmp_path, sqlite_uri, caplog):
    # The store's directory is blocked by a file (as an unmounted or lost share would leave it): every delivery
    # fails until it is back; nobody runs `worldpipe tracking sync`, the courier's own retries deliver.
    store_dir = tmp_path / "store"
    store_dir.write_text("not a directory")
    recorder = RunRecorder(True, f"sqlite:///{store_dir / 'mlflow.db'}", "spool-recovery", run_dir=tmp_path / "run",
                           retry_s=0.5)
    try:
        with caplog.at_level(logging.WARNING, logger="worldpipe.tracking"):
            recorder.start(None, "recovery", {})
            recorder.add_metrics(1, {"x": 1.0}, 1)
            recorder.stage(1)
            recorder.commit(1)  # returns at once: delivery is the courier's job
            assert recorder.await_run_id() is None and "unreachable" in caplog.text
            store_dir.unlink()
            store_dir.mkdir()
            shutil.copy(sqlite_uri.removeprefix("sqlite:///"), store_dir / "mlflow.db")  # the store is back
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
    finally:
        recorder.abandon()  # nothing left to stop after end(); the courier, if the test failed before it
    client = MlflowClient(f"sqlite:///{store_dir / 'mlflow.db'}")
    assert sorted((m.step, m.value) for m in client.get_metric_history(run_id, "x")) == [(1, 1.0), (2, 2.0)]
    assert client.get_run(run_id).info.status == "FINISHED"
