"""Case 1 of issue 9, the mechanism: a worker dies with its parent, and one started after its launcher died
exits at once. Real processes, real SIGKILL; the chain launcher -> torchrun -> worker is played by this test,
a middle python process and a worker python process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from processes import is_alive, wait_gone
from worldpipe.launch.lifeline import EXIT_ORPHANED, LAUNCHER_PID_ENV, parent_pid_of

pytestmark = pytest.mark.adversarial

WORKER = ("from worldpipe.launch.lifeline import bind_worker_to_launcher; import sys, time; bind_worker_to_launcher(); "
          "print('bound', flush=True); time.sleep(600)")
MIDDLE = ("import subprocess, sys; worker = subprocess.Popen([sys.executable, '-c', sys.argv[1]]); "
          "print(worker.pid, flush=True); worker.wait()")


def test_parent_pid_of_reads_proc():
    assert parent_pid_of(os.getpid()) == os.getppid()
    assert parent_pid_of(2**22 + 12345) is None


def test_worker_dies_when_its_parent_is_killed():
    env = {**os.environ, LAUNCHER_PID_ENV: str(os.getpid())}
    middle = subprocess.Popen([sys.executable, "-c", MIDDLE, WORKER], env=env, stdout=subprocess.PIPE, text=True)
    try:
        worker = int(middle.stdout.readline())
        assert is_alive(worker)
        # The worker's "bound" goes to the same pipe: it armed the signal and checked the chain.
        assert middle.stdout.readline().strip() == "bound"
        os.kill(middle.pid, signal.SIGKILL)
        middle.wait(timeout=30)
        assert not wait_gone({worker}, timeout=30), "the worker outlived its parent"
    finally:
        if middle.poll() is None:
            middle.kill()
            middle.wait()


def test_worker_whose_launcher_is_not_its_grandparent_exits_at_once():
    # The chain is broken (the launcher it names is not its parent's parent): as if the launcher died before
    # the worker could arm its signal.
    env = {**os.environ, LAUNCHER_PID_ENV: str(2**22 + 12345)}
    middle = subprocess.run([sys.executable, "-c", MIDDLE.replace("worker.wait()", "sys.exit(worker.wait())"),
                             WORKER], env=env, capture_output=True, text=True, timeout=120)
    assert middle.returncode == EXIT_ORPHANED, middle.stderr
    assert "bound" not in middle.stdout and "is gone" in middle.stderr


def test_without_a_launcher_nothing_is_checked():
    env = {k: v for k, v in os.environ.items() if k != LAUNCHER_PID_ENV}
    proc = subprocess.run([sys.executable, "-c", WORKER.replace("time.sleep(600)", "pass")], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "bound" in proc.stdout


# The chain again, with a torchrun stand-in that outlives the launcher (it arms no signal of its own): the worker
# is alive when the launcher is gone, and must not publish. In the real chain that is the moment between the
# launcher's death and torchrun's, which the signal takes to travel.
LAUNCHER = ("import subprocess, sys; from worldpipe.launch.lifeline import launcher_environment; "
            "subprocess.Popen([sys.executable, '-c', sys.argv[1], sys.argv[2], sys.argv[3]], "
            "env=launcher_environment()).wait()")
STANDIN = ("import subprocess, sys; worker = subprocess.Popen([sys.executable, '-c', sys.argv[1], sys.argv[2]]); "
           "print('exit', worker.wait(), flush=True)")
SAVING_WORKER = ("import sys, torch; from worldpipe.checkpoint.manager import CheckpointManager; "
                 "from worldpipe.launch.lifeline import bind_worker_to_launcher; bind_worker_to_launcher(); "
                 "manager = CheckpointManager(sys.argv[1], async_save=sys.argv[1].endswith('async')); "
                 "print('bound', flush=True); sys.stdin.readline(); "
                 "manager.save(1, {'model': {'w': torch.arange(4.0)}}); manager.close(); print('published', flush=True)")


@pytest.mark.parametrize("launcher_killed", [True, False], ids=["launcher_killed", "launcher_alive"])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_worker_whose_launcher_died_publishes_nothing(launcher_killed, mode, tmp_path):
    checkpoints = tmp_path / f"checkpoints-{mode}"
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, STANDIN, SAVING_WORKER, str(checkpoints)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert launcher.stdout.readline().strip() == "bound"
        if launcher_killed:
            launcher.kill()
            launcher.wait(timeout=30)
        launcher.stdin.write("save\n")
        launcher.stdin.flush()
        lines = [launcher.stdout.readline().strip() for _ in range(2 - launcher_killed)]
    finally:
        launcher.kill()
        launcher.wait(timeout=30)
    published = sorted(p.name for p in checkpoints.iterdir()) if checkpoints.exists() else []
    if launcher_killed:
        assert lines == [f"exit {EXIT_ORPHANED}"], launcher.stderr.read()
        assert "step-000001" not in published and "latest" not in published, published
        assert "is gone; not publishing step 1" in launcher.stderr.read()
    else:
        assert lines == ["published", "exit 0"], launcher.stderr.read()
        assert {"step-000001", "latest"} <= set(published)
