"""Bridge from a closed-loop evaluation to MLflow: which run and which logged model it belongs to."""

from __future__ import annotations

import logging
from typing import Any

from worldpipe.checkpoint.layout import step_identity
from worldpipe.evaluate.logged_model import find_logged_model
from worldpipe.evaluate.record import recorded_run_id
from worldpipe.tracking.connection import fail_fast_over_http, resolve_tracking_uri
from worldpipe.tracking.evaluation import log_control

log = logging.getLogger("worldpipe.control")


def record_control(result: dict[str, Any], checkpoints: str, uri: str | None, files: list[str]) -> str | None:
    """Log ``result`` onto the evaluated run (a child run per evaluation) and its logged model; the child run's
    id, None when the training ran untracked."""
    run_id = result.get("mlflow_run_id") or recorded_run_id(checkpoints)
    if not run_id:
        log.warning("the checkpoint records no MLflow run (training ran without tracking); nothing logged")
        return None
    fail_fast_over_http()
    identity = step_identity(checkpoints, int(result["checkpoint_step"]))  # the step evaluated
    uri = resolve_tracking_uri(uri or identity.get("config", {}).get("tracking", {}).get("uri"))
    model_id = find_logged_model(uri, run_id, result["checkpoint_digest"])
    return log_control(uri, run_id, result, files, model_id)
