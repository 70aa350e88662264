"""Delivering one training segment's records while they are journaled: on wake-ups, with retries after a failure,
one warning per outage, and the host's system metrics beside them.

The loop runs wherever delivery runs: in the courier process (:mod:`worldpipe.tracking.courier`, what the trainer
uses) or on a thread of the process that writes the journal (a :class:`~worldpipe.tracking.recorder.RunRecorder`
without a courier). Either way it only reads the durable journal and replays it with
:func:`~worldpipe.tracking.delivery.deliver`, so who delivers changes nothing in what arrives.

A segment starts with its ``open`` record (:meth:`DeliveryLoop.begin`): the first delivery attempt after it is
reported (``on_tried``: whoever needs the run id may now read it from the spool's state), and so is its
acknowledgement (``on_opened``: the run exists; system metrics taken so far are logged to it from then on).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from worldpipe.tracking.delivery import DeliveryReport, deliver
from worldpipe.tracking.spool import Spool
from worldpipe.tracking.system_metrics import SystemMetricsSampler

log = logging.getLogger("worldpipe.tracking")

# After a failed delivery the loop retries on its own, first after this many seconds, doubling up to `retry_s`:
# a server that comes back mid-run gets the waiting records without a manual sync.
RETRY_FIRST_S = 1.0


def retry_delay(failures: int, first_s: float, cap_s: float) -> float:
    """Seconds before retry number ``failures`` (1-based): exponential backoff from ``first_s``, capped."""
    return min(cap_s, first_s * 2.0 ** max(0, failures - 1))


class DeliveryLoop:
    """Replays a spool into MLflow on demand and after failures; samples the host during a segment."""

    def __init__(self, spool: Spool, uri: str, retry_s: float = 30.0,
                 on_tried: Callable[[], None] | None = None, on_opened: Callable[[], None] | None = None):
        self.spool = spool
        self.uri = uri
        self.retry_s = retry_s
        self.on_tried = on_tried  # once per segment: a delivery has tried its open record
        self.on_opened = on_opened  # once per segment: its open record is acknowledged (the run exists)
        self.retry_at: float | None = None  # monotonic time of the next retry while records wait
        self._failures = 0  # consecutive failed deliveries
        self._offline = False
        self._open_seq: int | None = None
        self._open_tried = False
        self._open_acked = False
        self._resume = False
        self._ending = False
        self._sampler: SystemMetricsSampler | None = None  # this segment's, from its start to its end
        self._sampler_attached = False
        self._monitor_lock = threading.Lock()  # a delivery attaches system metrics, stop_sampling() stops them

    # ---- segment ----
    def begin(self, open_seq: int, resume: bool, system_metrics_s: float = 0.0, system_metrics_samples: int = 1,
              ) -> None:
        """A segment opened with record ``open_seq``: start sampling the host (every ``system_metrics_s``; 0: off)."""
        self._open_seq, self._open_tried, self._open_acked = open_seq, False, False
        self._resume, self._ending = resume, False
        if system_metrics_s and system_metrics_s > 0:
            with self._monitor_lock:
                self._sampler = SystemMetricsSampler(system_metrics_s, self.uri, system_metrics_samples).start()
                self._sampler_attached = False

    def stop_sampling(self) -> None:
        """The segment ends: log the last system sample (before the run is marked terminated) and stop."""
        with self._monitor_lock:
            self._attach_system_metrics()  # a segment shorter than the run start still logs its samples
            sampler, self._sampler, self._ending = self._sampler, None, True
        if sampler is not None:
            sampler.stop()

    # ---- delivery ----
    def run(self, wait: Callable[[float | None], None], stopping: Callable[[], bool]) -> None:
        """Deliver after every ``wait`` (a wake-up, or the timeout: a retry is due) until ``stopping()``."""
        while not stopping():
            retry_at = self.retry_at
            wait(None if retry_at is None else max(0.0, retry_at - time.monotonic()))
            if stopping():
                break
            if self.retry_at is not None and time.monotonic() < self.retry_at:
                continue  # woken early by a new record: it waits with the others until the retry is due
            try:
                self.deliver_now()
            except Exception as err:  # noqa: BLE001 - the loop must survive anything; records stay spooled
                self._note_failure()
                log.warning("tracking delivery failed unexpectedly (%s); records stay spooled", err)

    def deliver_now(self) -> DeliveryReport:
        """Replay what is pending now; warn once when the server becomes unreachable, once when it is back."""
        try:
            return self._deliver_and_report()
        finally:  # after the warning, if any: whoever waits for the run start sees it said first
            self._opened()

    def _deliver_and_report(self) -> DeliveryReport:
        report = deliver(self.spool, self.uri, on_acked=self._acked)
        if report.error:
            self._note_failure()
            if not self._offline:
                log.warning(
                    "MLflow tracking at %s is unreachable (%s). Training continues; %d record(s) are spooled "
                    "durably in %s and will be replayed when the server answers again, or run: "
                    "worldpipe tracking sync %s", self.uri, report.error, report.pending, self.spool.journal,
                    self.spool.run_dir)
            self._offline = True
        else:
            self._failures, self.retry_at = 0, None
            if self._offline:
                log.warning("MLflow tracking at %s is reachable again: replayed %d spooled record(s)", self.uri,
                            report.delivered)
            self._offline = False
        return report

    def _note_failure(self) -> None:
        self._failures += 1
        self.retry_at = time.monotonic() + retry_delay(self._failures, min(RETRY_FIRST_S, self.retry_s),
                                                       self.retry_s)

    def _acked(self, record: dict) -> None:
        """The segment's start is acknowledged: say so now, not after the rest of the batch (the first one holds
        every config param and the start's artifacts, while the trainer's first checkpoint waits for the run id)."""
        if record["seq"] == self._open_seq:
            self._opened()

    def _opened(self) -> None:
        """After a delivery attempt: the segment's start has been tried; start the monitor once the run exists."""
        if self._open_seq is None or self._open_acked:
            return
        if not self._open_tried:
            self._open_tried = True
            if self.on_tried is not None:
                self.on_tried()
        if self.spool.state()["acked"] >= self._open_seq:
            self._open_acked = True
            if self.on_opened is not None:
                self.on_opened()
            with self._monitor_lock:
                self._attach_system_metrics()

    def _attach_system_metrics(self) -> None:
        """Log system metrics to the run once it exists (call with the monitor lock held)."""
        run_id = self.spool.state()["run_id"]
        if self._sampler is not None and not self._sampler_attached and not self._ending and run_id:
            self._sampler.attach(run_id, resume=self._resume)
            self._sampler_attached = True
