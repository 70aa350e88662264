"""shared_pool: one executor per process, and a forked child starts its own instead of the parent's dead one."""

import os
import signal

from worldpipe.checkpoint.thread_pool import shared_pool


def test_the_executor_is_made_once_and_kept():
    assert shared_pool("test-pool", 1) is shared_pool("test-pool", 1)
    assert shared_pool("test-pool", 1).submit(lambda: 41 + 1).result(timeout=30) == 42


def test_a_forked_child_gets_a_working_executor_of_its_own():
    parent_executor = shared_pool("test-fork", 2)
    assert parent_executor.submit(os.getpid).result(timeout=30) == os.getpid()
    pid = os.fork()
    if pid == 0:  # child: the parent's threads do not exist here; a submit to its executor would never run
        signal.alarm(20)
        try:
            fresh = shared_pool("test-fork", 2) is not parent_executor
            ran = shared_pool("test-fork", 2).submit(os.getpid).result(timeout=15) == os.getpid()
            os._exit(0 if fresh and ran else 3)
        except BaseException:  # noqa: BLE001 - any failure is the child's exit status
            os._exit(4)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert shared_pool("test-fork", 2) is parent_executor
