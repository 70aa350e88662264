"""CPU, memory, disk, network and (where present) GPU utilization of the training host, measured by MLflow's own
host monitors and logged through its system-metrics publisher (metrics ``system/...``, one step per logged
point), from rank 0 only.

They are measurements of the machine, not of the computation: they are not journaled or checkpoint-gated like
the training metrics, `rerun` ignores them, and a tracking server that is down just ends the logging.

Sampling starts with the segment, not with its MLflow run: the run is created in the background and exists only
seconds later (about as long as a smoke training lasts). So one thread samples from the start, keeps what it
took until the run exists (``run_id`` names it), logs that first and then every point as it is taken. MLflow's own monitor thread is not used: each of its threads reads CPU utilization 0 at its first
sample (psutil measures per thread since that thread's previous reading), and it asks the server for the run's
status before every sample.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import psutil

from worldpipe.tracking.connection import import_mlflow

log = logging.getLogger("worldpipe.tracking")

PREFIX = "system/"


class SystemMetricsSampler:
    """Samples the host every ``interval_s`` from :meth:`start` to :meth:`stop`; logs to the run once ``run_id()``
    names it (``resume``: continuing the step numbering of the run's earlier segments instead of starting at 0).

    Each logged point averages ``samples_per_point`` samples; :meth:`stop` takes one last sample, so a segment
    shorter than the interval still logs one point.
    """

    def __init__(self, interval_s: float, uri: str, samples_per_point: int = 1,
                 run_id: Callable[[], str | None] = lambda: None, resume: bool = False):
        self.interval_s = float(interval_s)
        self.uri = uri
        self.samples_per_point = max(1, int(samples_per_point))
        self._run_id, self._resume = run_id, resume
        self._lock = threading.Lock()  # the sampling thread publishes, stop() takes the last
        self._host = None  # an unbound SystemMetricsMonitor: MLflow's host monitors, nothing logged through it
        self._publisher = None  # a SystemMetricsMonitor bound to the run: its publish_metrics() numbers the steps
        self._waiting: list[dict[str, float]] = []  # points taken before the run existed
        self._collected = 0
        self._logged = 0
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._sample_until_stopped, name="worldpipe-system-metrics",
                                        daemon=True)

    def start(self) -> SystemMetricsSampler:
        """Start sampling now (on a thread: importing MLflow takes seconds the first steps need not wait)."""
        self._thread.start()
        return self

    @property
    def points(self) -> int:
        """Points taken so far (logged, or waiting for the run)."""
        with self._lock:
            return self._logged + len(self._waiting)

    def _sample_until_stopped(self) -> None:
        psutil.cpu_percent()  # from now: psutil's first reading on a thread is 0, not a measurement
        due = time.monotonic() + self.interval_s
        try:
            import_mlflow()
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            self._host = SystemMetricsMonitor(None, sampling_interval=self.interval_s, tracking_uri=self.uri)
        except Exception as err:  # noqa: BLE001 - telemetry must never stop training
            log.warning("system metrics are off for this run: %s", err)
            return
        # The first sample is due one interval after the priming, or at once if importing took longer: either way
        # it measures the segment's start, and never reads the 0 of a zero-length interval.
        while not self._stopping.wait(max(0.0, due - time.monotonic())):
            if not self._sample():
                return
            due = time.monotonic() + self.interval_s

    def _sample(self, last: bool = False) -> bool:
        """Take one sample; log a point when enough are averaged (or it is the last). False once logging failed."""
        with self._lock:
            self._host.collect_metrics()
            self._collected += 1
            if self._collected % self.samples_per_point and not last:
                return True
            point = self._host.aggregate_metrics()
            for monitor in self._host.monitors:
                monitor.clear_metrics()
            self._waiting.append(point)
            return self._publish()

    def _publish(self) -> bool:
        """Log the points taken so far, in order, once the run exists (call with the lock held); False once logging
        failed (it stops for this segment)."""
        try:
            if self._publisher is None and (run_id := self._run_id()):
                from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

                self._publisher = SystemMetricsMonitor(run_id, sampling_interval=self.interval_s,
                                                       resume_logging=self._resume, tracking_uri=self.uri)
                self._publisher.monitors = self._host.monitors  # one set of counters for the whole segment
            while self._publisher is not None and self._waiting:
                self._publisher.publish_metrics(self._waiting[0])
                self._waiting.pop(0)
                self._logged += 1
        except Exception as err:  # noqa: BLE001 - telemetry must never fail the run
            log.warning("system metrics stopped: %s", err)
            self._publisher, self._waiting, self._run_id = None, [], lambda: None  # no more logging this segment
            return False
        return True

    def stop(self) -> None:
        """Stop sampling, take one last sample and flush what is logged (before the run is marked terminated)."""
        self._stopping.set()
        if self._thread.ident is not None:
            self._thread.join()
        if self._host is None:
            return
        self._sample(last=True)
        with self._lock:
            if self._publisher is not None:
                try:
                    self._publisher.mlflow_logger.flush()
                except Exception as err:  # noqa: BLE001 - telemetry must never fail the run
                    log.warning("system metrics: the last points were not logged: %s", err)
