"""Names and locations decided once for the whole project (imported by the trainer, CLI and workflow)."""

from __future__ import annotations

from worldpipe.identity import PROJECT_ROOT

# Written by rank 0 when a training run reaches its last step: final step, digest, MLflow run id.
COMPLETION_RECORD = "train_done.json"

# The Hydra config tree of training runs.
CONF_DIR = PROJECT_ROOT / "conf"
