"""Run records of the pipeline (`worldpipe runs begin/end`) and what `worldpipe runs list` makes of them."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from worldpipe.cli import main
from worldpipe.config import paths
from worldpipe.pipeline.plan import launch_overrides, plan
from worldpipe.pipeline.run_index import RunDirMismatch, begin, end, experiment_runs

REPO = Path(__file__).resolve().parents[2]


def planned_run(overrides=()):
    config = yaml.safe_load((REPO / "conf/pipeline/default.yaml").read_text())
    config["train"]["overrides"] = list(overrides)
    return plan(config, REPO / "conf")[1]["pendulum_rssm"]


@pytest.fixture
def workdir(tmp_path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)  # run directories are relative to the working directory, as in the pipeline
    monkeypatch.delenv(paths.CONF_DIR_ENV, raising=False)
    return tmp_path


def start(run) -> Path:
    begin(run.dir, run.dataset.spec_hash, launch_overrides(run))
    return Path(run.dir)


def test_begin_records_the_run_and_points_latest_at_it(workdir):
    run = planned_run()
    run_dir = start(run)
    record = json.loads((run_dir / paths.RUN_RECORD).read_text())
    assert record["config_hash"] == run.config_hash and record["run_hash"] == run_dir.name
    assert record["config"]["trainer.lr"] == 1.0e-3
    assert os.readlink(run_dir.parent / "latest") == run_dir.name
    start(run)  # a second attempt keeps the first start time and adds an attempt
    again = json.loads((run_dir / paths.RUN_RECORD).read_text())
    assert again["started_at"] == record["started_at"] and len(again["attempts"]) == 2


def test_begin_refuses_a_directory_that_is_not_the_configs_hash(workdir):
    run = planned_run()
    with pytest.raises(RunDirMismatch, match="is not this config's run"):
        begin(f"{Path(run.dir).parent}/000000000000", run.dataset.spec_hash, launch_overrides(run))
    assert not Path(run.dir).parent.exists()


def test_status_follows_checkpoints_exit_codes_and_completion(workdir):
    run_dir = start(planned_run())

    def status():
        (info,) = experiment_runs(run_dir.parent)
        return info.status

    assert status() == "interrupted before its first checkpoint"  # killed: no exit code recorded
    (run_dir / "checkpoints").mkdir()
    (run_dir / "checkpoints/latest").write_text("step-000250\n")
    end(run_dir, 75)
    assert status() == "interrupted at step 250 (preempted)"
    end(run_dir, 1)
    assert status() == "failed at step 250 (exit code 1)"
    (run_dir / paths.COMPLETION_RECORD).write_text(json.dumps({"final_step": 3000, "mlflow_run_id": "abc"}))
    assert status() == "finished at step 3000"


def test_runs_list_shows_each_run_with_what_changed(workdir, capsys):
    first = start(planned_run())
    second = start(planned_run(["trainer.lr=3e-4"]))
    assert main(["runs", "list"]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = [line for line in out if line.startswith("  ") and not line.startswith("      ")]
    assert [row.split()[0] for row in rows] == [first.name, second.name]
    assert rows[1].endswith("<- latest")
    assert "      trainer.lr: 0.001 -> 0.0003" in out
    assert main(["runs", "list", "no_such_experiment"]) == 2  # bad input


def test_runs_list_shows_a_runs_closed_loop_and_a_rerun_as_a_rerun_of_its_source(workdir, capsys):
    first = start(planned_run())
    control = first / paths.CONTROL_DIR / "016b08a5c025"
    control.mkdir(parents=True)
    control.joinpath("control.json").write_text(json.dumps({"score": 0.7619, "contenders": {
        "planner": {"mean": -144.75, "ci95": [-205.13, -84.37], "episodes": 2}}}))
    rebuilt = first.parent / "rerun-8009c254-20261206-101653"  # as `worldpipe rerun` lays it out
    rebuilt.mkdir()
    rebuilt.joinpath(paths.RUN_RECORD).write_text(json.dumps({
        "experiment": first.parent.name, "started_at": "9999", "attempts": [{"exit_code": 0}],
        "rebuilt": {"kind": "rerun", "of_mlflow_run_id": "8009c254904e", "of_run_dir": str(first),
                    "verdict": "bit-identical (58 metrics)"}}))
    rebuilt.joinpath(paths.COMPLETION_RECORD).write_text('{"final_step": 40}')
    assert main(["runs", "list"]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = [line for line in out if line.startswith("  ") and not line.startswith("      ")]
    assert [row.split()[0] for row in rows] == [first.name, rebuilt.name]
    assert "      control: return -144.8 [95% CI -205.1, -84.4] over 2 episodes, score 0.762 (control/016b08a5c025)" in out
    assert f"      rerun of {first.name} (mlflow 8009c254904e): bit-identical (58 metrics)" in out
    assert "(same identity as the previous run)" not in "\n".join(out)


def _finished(run_dir: Path) -> None:
    """What a finished attempt leaves: the completion record, an evaluation, the loss curve, checkpoints."""
    (run_dir / "eval" / "abc123").mkdir(parents=True)
    (run_dir / "eval" / "abc123" / "metrics.json").write_text("{}")
    (run_dir / "loss_curve.png").write_bytes(b"png")
    (run_dir / paths.COMPLETION_RECORD).write_text('{"final_step": 40}')
    (run_dir / "checkpoints" / "step-000040").mkdir(parents=True)


def test_a_new_attempt_removes_the_previous_attempts_results(workdir):
    """Issue 19, case 14: Snakemake calls a run done from these files; a new attempt must not leave them."""
    run = planned_run()
    run_dir = start(run)
    _finished(run_dir)
    start(run)
    assert sorted(p.name for p in run_dir.iterdir()) == ["checkpoints", paths.RUN_RECORD]
    assert (run_dir / "checkpoints" / "step-000040").is_dir()
    assert len(json.loads((run_dir / paths.RUN_RECORD).read_text())["attempts"]) == 2


def test_begin_refuses_a_run_another_process_trains_in_and_changes_nothing(workdir, capsys):
    """The holder of the run lock (here a real process, as an orphaned launcher would be) is named."""
    import subprocess
    import sys

    run = planned_run()
    run_dir = start(run)
    _finished(run_dir)
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from worldpipe.launch.run_lock import RunLock; "
                               "RunLock(sys.argv[1]).acquire(); print('held', flush=True); time.sleep(600)",
                               str(run_dir)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        before = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*"))
        rc = main(["runs", "begin", str(run_dir), "--dataset-spec-hash", run.dataset.spec_hash,
                   *launch_overrides(run)])
        assert rc == 1  # in use, as `worldpipe train` says it (docs/troubleshooting.md#exit-statuses)
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and f"in use by pid {holder.pid} " in err[0]
        assert sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*")) == before
        assert len(json.loads((run_dir / paths.RUN_RECORD).read_text())["attempts"]) == 1
    finally:
        holder.kill()
        holder.wait(timeout=30)


def _progress(run_dir: Path, lines: list[dict], cut_tail: bool = False) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(line) + "\n" for line in lines) + ('{"step": 9' if cut_tail else "")
    (run_dir / paths.PROGRESS_RECORD).write_text(text)


def test_runs_status_shows_running_and_recent_runs_from_their_progress_records(workdir, capsys):
    import time

    from worldpipe.tracking.spool import Spool

    now = time.time()
    running = workdir / "results/runs/smoke/aaaaaaaaaaaa"
    _progress(running, [{"step": s, "target_steps": 40, "loss": 1.0 / s, "steps_per_s": 2.0, "time": now - 2}
                        for s in (5, 10)], cut_tail=True)  # a line a crash cut short is skipped
    spool = Spool(running)
    spool.hold_active()  # what a live training process holds
    old = workdir / "results/runs/smoke/bbbbbbbbbbbb"
    _progress(old, [{"step": 40, "target_steps": 40, "loss": 0.5, "steps_per_s": 3.0, "time": now - 3 * 3600}])
    (old / paths.COMPLETION_RECORD).write_text(json.dumps({"final_step": 40}))
    point = workdir / "results/sweeps/lr/trainer.lr-0.001"
    _progress(point, [{"step": 20, "target_steps": 20, "loss": 0.25, "steps_per_s": 4.0, "time": now - 60}])
    (point / paths.COMPLETION_RECORD).write_text(json.dumps({"final_step": 20}))
    try:
        assert main(["runs", "status"]) == 0
        rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
        assert set(rows) == {str(running.relative_to(workdir)), str(point.relative_to(workdir))}
        assert rows[str(running.relative_to(workdir))].split()[1:6] == ["10/40", "0.1", "2", "15s", "2s"]
        assert "running" in rows[str(running.relative_to(workdir))]
        assert "finished at step 20" in rows[str(point.relative_to(workdir))]
        assert main(["runs", "status", "--recent", "600"]) == 0
        assert str(old.relative_to(workdir)) in capsys.readouterr().out
    finally:
        spool.release_active()
    assert main(["runs", "status", str(workdir / "nothing")]) == 2  # bad input
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no progress record" in err and "nothing" in err


def test_runs_status_watch_follows_a_run_until_it_stops(workdir, capsys):
    import threading
    import time

    from worldpipe.tracking.spool import Spool

    running = workdir / "results/runs/smoke/cccccccccccc"
    _progress(running, [{"step": 5, "target_steps": 40, "loss": 1.0, "steps_per_s": 2.0, "time": time.time()}])
    spool = Spool(running)
    spool.hold_active()
    stopper = threading.Timer(0.8, spool.release_active)  # the training ends
    stopper.start()
    try:
        assert main(["runs", "status", "--watch", "0.2"]) == 0
    finally:
        stopper.join()
    tables = capsys.readouterr().out.count("RUN ")
    assert tables >= 2  # shown again while the run ran, and once after it stopped
    assert main(["runs", "status", "--watch", "0"]) == 2
