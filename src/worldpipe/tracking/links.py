"""Links into the MLflow UI that open the *Model training* view.

MLflow 3's UI picks its layout from the URL's ``workflowType`` or else the browser's last choice, GenAI on a first
visit; the experiment's ``mlflow.experimentKind`` tag does not change it. So every link worldpipe prints carries
``workflowType=machine_learning``, and MLflow's own "View run … at: URL" line (no query: the GenAI layout) is
suppressed by the CLI.
"""

from __future__ import annotations

WORKFLOW_QUERY = "workflowType=machine_learning"
# The completion record's key for the run's experiment id (next to mlflow_run_id): enough for the run's link.
MLFLOW_EXPERIMENT_KEY = "mlflow_experiment_id"
# Where `mlflow ui` listens by default: the link for a local (file or SQLite) store opened with it.
LOCAL_UI = "http://127.0.0.1:5000"


def _page(tracking_uri: str, path: str) -> str:
    """Page ``experiments/<path>`` of the UI of a tracking URI (the server itself, or `mlflow ui`'s default for a
    local store) in the Model training view."""
    base = tracking_uri.rstrip("/") if tracking_uri.startswith(("http://", "https://")) else LOCAL_UI
    return f"{base}/#/experiments/{path}?{WORKFLOW_QUERY}"


def run_url(tracking_uri: str, experiment_id: str, run_id: str) -> str:
    """The run's page in the Model training view."""
    return _page(tracking_uri, f"{experiment_id}/runs/{run_id}")


def experiment_url(tracking_uri: str, experiment_id: str) -> str:
    """The experiment's run list in the Model training view."""
    return _page(tracking_uri, f"{experiment_id}/runs")


def model_url(tracking_uri: str, experiment_id: str, model_id: str) -> str:
    """A logged model's page in the Model training view."""
    return _page(tracking_uri, f"{experiment_id}/models/{model_id}")
