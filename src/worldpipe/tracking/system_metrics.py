"""CPU, memory, disk, network and (where present) GPU utilization of the training host, through MLflow's own
system-metrics monitor (metrics ``system/...``, one step per sample), from rank 0 only.

They are measurements of the machine, not of the computation: they are not journaled or checkpoint-gated like
the training metrics, `rerun` ignores them, and a tracking server that is down just ends the sampling.
"""

from __future__ import annotations

import logging

log = logging.getLogger("worldpipe.tracking")

PREFIX = "system/"


def start_system_metrics(run_id: str | None, uri: str, interval_s: float, resume: bool, samples: int = 1):
    """A started ``SystemMetricsMonitor`` sampling every ``interval_s`` for ``run_id`` (None: off or no run).

    Each logged point averages ``samples`` samples. ``resume`` continues the step count of the run's earlier
    segments instead of restarting at 0.
    """
    if not run_id or not interval_s or interval_s <= 0:
        return None
    try:
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        monitor = SystemMetricsMonitor(run_id, sampling_interval=float(interval_s), resume_logging=resume,
                                       samples_before_logging=int(samples), tracking_uri=uri)
        monitor.start()
    except Exception as err:  # noqa: BLE001 - telemetry must never stop training
        log.warning("system metrics are off for this run: %s", err)
        return None
    return monitor


def stop_system_metrics(monitor) -> None:
    """Stop sampling, take one last sample and flush (before the run is marked terminated).

    The last sample gives every segment at least one, however short it was compared with the interval.
    """
    if monitor is None:
        return
    try:
        monitor.finish()  # stops and joins the sampling thread, flushes its samples
        monitor.collect_metrics()
        monitor.publish_metrics(monitor.aggregate_metrics())
        monitor.mlflow_logger.flush()
    except Exception as err:  # noqa: BLE001 - telemetry must never fail the run
        log.warning("stopping system metrics failed: %s", err)
