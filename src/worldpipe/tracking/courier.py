"""The courier: the child process that delivers a training run's records to MLflow and samples the host's system
metrics, so the training process never imports MLflow nor runs a delivery or sampling thread (their GIL time
slowed its first steps: docs/benchmarks.md). It replays the durable journal (:mod:`worldpipe.tracking.spool`) as
``worldpipe tracking sync`` does, continuously, for one segment (:class:`~worldpipe.tracking.delivery.DeliveryLoop`).
Started ahead of its segment (by the recorder, or before torch loads by the launcher: :func:`start_early`), it
imports MLflow, opens the store and waits until the recorder, having journaled the segment's ``open``, wakes it.

Control, parent -> courier, one byte each on its stdin: ``w`` records were appended (never blocking: a wake-up
already waiting is enough), ``s`` the segment ends (log the last system sample), ``x`` deliver everything (the
``end`` record is journaled), report, exit. End of file, or another parent PID (checked every second, in case a
child forked by the parent holds the pipe), is the parent's death (``kill -9`` included): the courier exits after
the delivery in flight. Replies, courier -> parent, JSON lines on a pipe of their own (MLflow may print on
stdout): ``tried`` (the segment's ``open`` record was tried: a run id, if any, is in the spool's ``state.json``),
``opened`` (the run exists), ``log`` (re-emitted by the parent under the same logger), ``done`` (delivered).

The courier runs in the parent's process group, at its CPU priority until the run start has been tried (the first
checkpoint waits for it) and at nice +10 after, ignores SIGINT and SIGTERM (the parent, which answers them with a
checkpoint, says when it ends), and is started with ``subprocess`` (no fork of a torch-loaded process). Its PID is
in ``RUN_DIR/tracking/courier.json`` while it runs; the parent stops and reaps it by that PID.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from worldpipe.core.atomic import write_text_atomic
from worldpipe.tracking.connection import fail_fast_over_http, tracking_client
from worldpipe.tracking.delivery import DeliveryLoop
from worldpipe.tracking.spool import Spool

log = logging.getLogger("worldpipe.tracking")

MODULE = "worldpipe.tracking.courier"
# In the spool directory while a courier runs: {"pid", "parent_pid", "before_torch"}; the last says whether it was
# started before its parent imported torch (early enough for MLflow's import to overlap torch's).
RECORD_NAME = "courier.json"
WAKE, STOP_SAMPLING, FINISH = b"w", b"s", b"x"
NICE = 10  # after the start: what is left is never waited for before the end (docs/benchmarks.md compares both)
PARENT_POLL_S = 1.0  # how often an idle courier checks that its parent is alive (besides the pipe's end of file)
EXIT_WAIT_S = 10.0  # how long a courier that has reported may take to exit before it is killed


class Courier:
    """The training process's handle on its courier: wake it, end its segment, stop and reap it by PID."""

    def __init__(self, proc: subprocess.Popen, replies: int, record: os.PathLike):
        self._proc = proc
        self._control: int | None = proc.stdin.fileno()
        os.set_blocking(self._control, False)
        self._record = record
        # Whom its replies tell: nobody until a recorder takes it (:meth:`report_to`).
        self._on_tried: Callable[[], None] = lambda: None
        self._on_opened: Callable[[], None] = lambda: None
        self._delivered = False  # the final report arrived
        self._done = threading.Event()  # the final report arrived, or the courier is gone
        # Blocks in os.read (no GIL held) until the courier writes; a handful of lines per segment.
        self._reader = threading.Thread(target=self._read_replies, args=(replies,), name="worldpipe-courier-replies",
                                        daemon=True)
        self._reader.start()

    @classmethod
    def start(cls, spool: Spool, uri: str, retry_s: float, system_metrics_s: float,
              system_metrics_samples: int) -> Courier:
        """Start a courier for the run of ``spool`` (raises OSError if no process can be started): it imports
        MLflow, then waits for its first wake-up, sent once its segment's ``open`` record is journaled."""
        replies, reply_end = os.pipe()
        settings = {"run_dir": str(spool.run_dir), "uri": uri, "parent": os.getpid(), "reply_fd": reply_end,
                    "retry_s": retry_s, "system_metrics_s": system_metrics_s or 0.0,
                    "system_metrics_samples": system_metrics_samples,
                    "log_level": logging.getLogger().getEffectiveLevel()}
        try:
            proc = subprocess.Popen([sys.executable, "-m", MODULE, json.dumps(settings)], stdin=subprocess.PIPE,
                                    pass_fds=(reply_end,))
        except BaseException:
            os.close(replies)
            raise
        finally:
            os.close(reply_end)
        record = spool.dir / RECORD_NAME
        write_text_atomic(record, json.dumps({"pid": proc.pid, "parent_pid": os.getpid(),
                                              "before_torch": "torch" not in sys.modules}))
        return cls(proc, replies, record)

    def report_to(self, on_tried: Callable[[], None], on_opened: Callable[[], None]) -> None:
        """Whom its replies tell (it replies only once woken, after its recorder took it)."""
        self._on_tried, self._on_opened = on_tried, on_opened

    @property
    def pid(self) -> int:
        return self._proc.pid

    def alive(self) -> bool:
        return self._proc.poll() is None

    def wake(self) -> None:
        """Records were appended: deliver them (returns at once)."""
        self._send(WAKE)

    def stop_sampling(self) -> None:
        """The segment ends: the courier logs its last system sample before any delivery of the end record."""
        self._send(STOP_SAMPLING)

    def finish(self, timeout_s: float) -> str:
        """Deliver everything journaled, then exit: "done", "busy" after ``timeout_s`` (the courier is killed), or
        "gone" if it had died before."""
        if not self.alive():
            self._reap()
            return "gone"
        self._send(FINISH)
        if not self._done.wait(timeout_s):
            self._reap()
            return "busy"
        self._reap(EXIT_WAIT_S)
        return "done" if self._delivered else "gone"

    def abandon(self) -> None:
        """Close the control pipe, as the parent's death would: the courier exits without a final delivery."""
        self._control = None
        with contextlib.suppress(OSError):
            self._proc.stdin.close()
        self._reap(EXIT_WAIT_S)

    def _send(self, byte: bytes) -> None:
        if self._control is None:
            return  # reaped: its descriptor number may belong to another file by now
        with contextlib.suppress(OSError):  # a full pipe holds wake-ups enough; a gone courier: finish() notices
            os.write(self._control, byte)

    def _reap(self, wait_s: float = 0.0) -> None:
        """Wait up to ``wait_s`` for the courier's exit (then kill it by PID), then forget it."""
        try:
            self._proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._control = None
        with contextlib.suppress(OSError):
            self._proc.stdin.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._record)
        # Its replies end with its exit: read to the end here, so none of them reaches a later segment.
        self._reader.join(EXIT_WAIT_S)
        self._done.set()

    def _read_replies(self, fd: int) -> None:
        buffer = b""
        try:
            while chunk := os.read(fd, 65536):
                *lines, buffer = (buffer + chunk).split(b"\n")
                for message in map(json.loads, lines):
                    if "log" in message:
                        name, level, text = message["log"]
                        logging.getLogger(name).log(level, "%s", text)
                    elif "tried" in message:
                        self._on_tried()
                    elif "opened" in message:
                        self._on_opened()
                    elif "done" in message:
                        self._delivered = True
                        self._done.set()
        except Exception as err:  # noqa: BLE001 - a garbled reply must not kill the training process
            log.warning("tracking courier: unreadable reply (%s)", err)
        finally:
            os.close(fd)
            self._on_tried()  # nobody waits for a run start the courier can no longer report
            self._done.set()


# Couriers started before the trainer exists (one per run directory and URI): the recorder of that run takes its
# own (:func:`adopt_early`), any other is abandoned then.
_EARLY: dict[tuple[str, str], Courier] = {}


def start_early(run_dir: str | os.PathLike, uri: str, system_metrics_s: float, system_metrics_samples: int,
                retry_s: float = 30.0) -> None:
    """Start a run's courier now, ahead of its trainer (a one-process run's launcher, rank 0's worker; before
    torch loads): MLflow's import and store then overlap the trainer's own start-up. A courier that cannot start
    is left to the recorder."""
    with contextlib.suppress(OSError):
        _EARLY[(str(Path(run_dir).resolve()), uri)] = Courier.start(Spool(run_dir), uri, retry_s, system_metrics_s,
                                                                    system_metrics_samples)


def adopt_early(run_dir: str | os.PathLike, uri: str) -> Courier | None:
    """The courier :func:`start_early` started for this run, if any and still alive."""
    courier = _EARLY.pop((str(Path(run_dir).resolve()), uri), None)
    for other in _EARLY.values():  # started for another run or URI: never used
        other.abandon()
    _EARLY.clear()
    return courier if courier is not None and courier.alive() else None


# ---- the courier process ----
class _Replies(logging.Handler):
    """JSON lines to the parent, one write each (atomic below PIPE_BUF), from any thread; log records among them."""

    def __init__(self, fd: int):
        super().__init__()
        self._fd = fd

    def send(self, **message: Any) -> None:
        view = memoryview((json.dumps(message) + "\n").encode())
        with self.lock, contextlib.suppress(OSError):  # a dead parent reads nothing
            while view:
                view = view[os.write(self._fd, view):]

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.send(log=[record.name, record.levelno, record.getMessage()])
        except Exception:  # noqa: BLE001 - logging must not raise
            self.handleError(record)


class _Control:
    """The parent's bytes on stdin, read between deliveries."""

    def __init__(self, parent: int, on_stop_sampling: Callable[[], None]):
        self._parent = parent
        self._on_stop_sampling = on_stop_sampling
        self.finishing = False  # ``x``: deliver everything and exit
        self.orphaned = False  # the parent is gone: exit now
        self.woken = False  # any byte has arrived

    def wait(self, deadline: float = math.inf) -> None:
        """Until a byte arrives, the parent dies, or the monotonic clock reaches ``deadline``."""
        while True:
            if select.select([sys.stdin], [], [], min(PARENT_POLL_S, max(0.0, deadline - time.monotonic())))[0]:
                data = os.read(sys.stdin.fileno(), 65536)
                self.woken, self.orphaned = True, self.orphaned or not data
                if STOP_SAMPLING in data:
                    self._on_stop_sampling()
                self.finishing = self.finishing or FINISH in data
                return
            if os.getppid() != self._parent:
                self.orphaned = True
                return
            if time.monotonic() >= deadline:
                return


def serve(settings: str) -> int:
    """The courier's life, with the ``settings`` (JSON) :meth:`Courier.start` passes: wait for its segment,
    deliver on wake-ups until told to finish (report, exit) or orphaned (exit)."""
    args = SimpleNamespace(**json.loads(settings))
    fail_fast_over_http()  # the launcher may have started us before the recorder set them in its own process
    replies = _Replies(args.reply_fd)
    logging.getLogger().addHandler(replies)
    logging.getLogger().setLevel(args.log_level)
    if os.getppid() != args.parent:
        return 0  # the parent died before we started
    # The parent decides when the courier ends (``x``, or its own end): a Ctrl-C or a SIGTERM sent to the whole
    # process group (a preemption the trainer answers with a checkpoint) must not cut the run's last records.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)

    def tried() -> None:
        replies.send(tried=True)
        with contextlib.suppress(OSError):  # a sandbox refusing it costs the training step some speed, nothing else
            os.nice(NICE)

    spool = Spool(args.run_dir)
    loop = DeliveryLoop(spool, args.uri, args.retry_s, on_tried=tried, on_opened=lambda: replies.send(opened=True))
    control = _Control(args.parent, loop.stop_sampling)
    # MLflow's import and store (seconds of CPU) overlap the trainer's set-up instead of its first steps.
    with contextlib.suppress(Exception):  # a store that cannot be opened is the delivery's to report
        tracking_client(args.uri)
    while not (control.woken or control.orphaned):
        control.wait()
    opened = [record for record in spool.records() if record.get("op") == "open"]
    if control.orphaned or not opened:
        return 0  # never given a segment: nothing to deliver
    loop.begin(opened[-1]["seq"], int(opened[-1].get("resume_step") or 0) > 0, args.system_metrics_s,
               args.system_metrics_samples)
    while not (control.finishing or control.orphaned):
        if loop.due():  # woken early by a new record while a retry waits: it waits with the others
            loop.deliver_now()
        control.wait(math.inf if loop.retry_at is None else loop.retry_at)
    if control.orphaned:
        return 0  # the records wait in the journal: the next start or `worldpipe tracking sync` delivers them
    loop.stop_sampling()  # a no-op if ``s`` came first
    loop.deliver_now()
    replies.send(done=True)  # what is left pending is in the spool's state
    return 0


if __name__ == "__main__":
    sys.exit(serve(sys.argv[1]))
