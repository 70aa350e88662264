"""worldpipe.core.process_exit.exit_process: the end of a process without the final collections over its
objects still joins its threads, runs its atexit handlers and flushes what it printed; the status is what
sys.exit would give."""

from __future__ import annotations

import subprocess
import sys
import textwrap

PROGRAM = textwrap.dedent("""
    import atexit, sys, threading, time
    from worldpipe.core.process_exit import exit_process

    def late_write():
        time.sleep(0.3)
        open(sys.argv[1] + "/thread", "w").write("joined")

    threading.Thread(target=late_write).start()
    atexit.register(lambda: open(sys.argv[1] + "/atexit", "w").write("ran"))
    sys.stdout.write("buffered, not yet flushed")
    exit_process(eval(sys.argv[2]))
""")


def _run(tmp_path, status: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PROGRAM, str(tmp_path), status], capture_output=True, text=True,
                          timeout=60)


def test_threads_atexit_and_buffers_are_finished_before_the_exit(tmp_path):
    proc = _run(tmp_path, "3")
    assert proc.returncode == 3
    assert proc.stdout == "buffered, not yet flushed"
    assert (tmp_path / "thread").read_text() == "joined"
    assert (tmp_path / "atexit").read_text() == "ran"


def test_status_as_sys_exit_gives_it(tmp_path):
    assert _run(tmp_path, "None").returncode == 0
    message = _run(tmp_path, "'worldpipe: error: stopped'")
    assert message.returncode == 1 and message.stderr.strip() == "worldpipe: error: stopped"
