"""An async save's publication runs at the lowest CPU priority; everything else keeps the process's priority.

Read from the kernel (``getpriority`` on each thread id), on the real threads a save starts: Linux only, where a
priority belongs to one thread.
"""

import os
import re
import sys
import threading

import pytest

from checkpoint_states import example_state
from worldpipe.checkpoint import CheckpointManager
from worldpipe.checkpoint.thread_pool import BACKGROUND_NICE

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread priority is Linux's")

BACKGROUND = re.compile(r"ckpt-(writer|sha256-bg|fsync-bg)_\d+$")
NORMAL_POOLS = re.compile(r"ckpt-(sha256|fsync|snapshot-copy)_\d+$")


def nice_of(thread: threading.Thread) -> int:
    return os.getpriority(os.PRIO_PROCESS, thread.native_id)


def threads(pattern: re.Pattern) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if pattern.match(t.name) and t.native_id is not None]


def test_async_publication_yields_the_cpu_and_sync_saves_do_not(tmp_path):
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    state = example_state()
    CheckpointManager(tmp_path / "sync").save(1, state)  # the process-wide normal pools exist from here on
    with CheckpointManager(tmp_path / "async", async_save=True) as manager:
        manager.save(1, state)
        manager.wait()
        writers = threads(BACKGROUND)
        assert {re.sub(r"_\d+$", "", t.name) for t in writers} == {"ckpt-writer", "ckpt-sha256-bg", "ckpt-fsync-bg"}
        assert {nice_of(t) for t in writers} == {max(base, BACKGROUND_NICE)}
    # A sync save after it hashes and fsyncs on threads at the training thread's priority, never the lowered ones.
    CheckpointManager(tmp_path / "sync").save(2, state)
    normal = threads(NORMAL_POOLS)
    assert normal and {nice_of(t) for t in normal} == {base}
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == base
    assert CheckpointManager(tmp_path / "async").verify(1) == []


def test_a_benchmark_can_keep_the_writer_at_normal_priority(tmp_path):
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    with CheckpointManager(tmp_path, async_save=True, background_priority=False) as manager:
        manager.save(1, example_state())
        manager.wait()
        writer = [t for t in threading.enumerate() if t.name.startswith("ckpt-writer_")
                  and t.native_id is not None and nice_of(t) == base]
        assert writer, "the normal-priority writer thread"


def test_a_save_that_is_waited_for_publishes_on_the_callers_thread(tmp_path):
    # A final save is waited for anyway: at background priority the machine's other work could starve it.
    from worldpipe.checkpoint.fault import hooked

    publishers = []
    with (hooked("before_files", lambda step: publishers.append((step, threading.current_thread()))),
          CheckpointManager(tmp_path, async_save=True) as manager):
        manager.save(1, example_state(seed=1))
        manager.save(2, example_state(seed=2), wait=True)  # waits for step 1 first, then publishes step 2 here
        assert not manager.writer.publishing() and [i.step for i in manager.list()] == [1, 2]
    assert publishers[0][1] is not threading.main_thread() and publishers[1] == (2, threading.main_thread())
