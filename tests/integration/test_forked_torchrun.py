"""torchrun forked from the launcher (worldpipe.launch.forked): it starts with torch imported, its workers are the
usual fresh interpreters, and the run ends with the same bits as under a freshly started torchrun."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from worldpipe.launch.forked import START_ENV

pytestmark = [pytest.mark.integration]


def _trained(run_dir: Path, dataset, env: dict, start: str) -> tuple[list[dict], dict]:
    store, manifest = dataset
    trace = run_dir.parent / f"{run_dir.name}.trace"
    cmd = ["worldpipe", "train", "experiment=smoke", f"run_dir={run_dir}", f"data.store={store}",
           f"data.manifest={manifest}", "tracking.enabled=false", "trainer.progress_bar=false", "trainer.steps=4",
           "checkpoint.every=2"]
    proc = subprocess.run(cmd, env={**env, "WORLDPIPE_STARTUP_TRACE": str(trace), START_ENV: start},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = [json.loads(line) for line in trace.read_text().splitlines()]
    return events, json.loads((run_dir / "train_done.json").read_text())


def _one(events: list[dict], name: str) -> dict:
    (event,) = [e for e in events if e["event"] == name]
    return event


@pytest.mark.slow  # default tier over its 5 minutes (407 s here on 2026-12-03): make test runs it
def test_forked_torchrun_trains_the_same_bits_as_a_fresh_one(tmp_path, smoke_dataset, env_with_venv):
    forked, forked_done = _trained(tmp_path / "forked", smoke_dataset, env_with_venv, "fork")
    fresh, fresh_done = _trained(tmp_path / "fresh", smoke_dataset, env_with_venv, "exec")
    for events, expect_fork in ((forked, True), (fresh, False)):
        spawned, started = _one(events, "torchrun_spawned"), _one(events, "torchrun_main")
        assert spawned["forked"] is expect_fork and started["torch_preloaded"] is expect_fork
        assert started["pid"] == spawned["torchrun_pid"] != spawned["pid"]
        workers = {e["pid"] for e in events if e["event"] == "train_imported"}
        assert len(workers) == 2 and spawned["pid"] not in workers and started["pid"] not in workers
    assert forked_done["final_step"] == fresh_done["final_step"] == 4
    assert forked_done["digest"] == fresh_done["digest"]


# Run in a fresh interpreter, as a launcher is: the test process itself may hold other tests' threads.
CAN_FORK_PROGRAM = """
import sys, threading
from worldpipe.launch.forked import can_fork
from worldpipe.launch.torchrun import torchrun_argv

cmd = torchrun_argv(2, ["-m", "worldpipe.launch.worker", "--config=x"])
seen = [can_fork(cmd), can_fork([sys.executable, "-m", "torch.distributed.run", *cmd[3:]])]
release = threading.Event()
other = threading.Thread(target=release.wait)
other.start()
seen.append(can_fork(cmd))
release.set()
other.join()
seen.append(can_fork(cmd))
print(seen)
"""


def test_no_fork_while_another_thread_runs_or_for_another_command():
    proc = subprocess.run([sys.executable, "-c", CAN_FORK_PROGRAM], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    # alone: fork; another command: no; a second thread running: no; joined again: fork
    assert proc.stdout.split("\n")[-2] == "[True, False, False, True]"
