"""MLflow imported once per process, by whichever thread needs it first.

MLflow's package has import cycles that fail ("partially initialized module") when two threads import it at the
same moment. A training process does exactly that at its start: the delivery thread opens the run while the
early system-metrics sampler starts sampling. Both import through here, so they take turns.
"""

from __future__ import annotations

import threading

_IMPORT_LOCK = threading.Lock()


def import_mlflow() -> None:
    """Import the MLflow modules the recorder's threads use (a no-op once done)."""
    with _IMPORT_LOCK:
        import mlflow.system_metrics.system_metrics_monitor  # noqa: F401 - imported for the side effect
        import mlflow.tracking  # noqa: F401 - imported for the side effect
