"""Snakemake script: plot the training loss terms recorded in the run's MLflow record."""

import json
import sys
from pathlib import Path

from mlflow.tracking import MlflowClient

from worldpipe.evaluate.open_loop import plot_loss_curve

snakemake = globals()["snakemake"]  # injected by Snakemake's script directive
sys.stderr = open(snakemake.log[0], "w")  # noqa: SIM115 - the log must stay open for the whole script

record = json.loads(Path(snakemake.input.done).read_text())
client = MlflowClient(tracking_uri=snakemake.params.tracking)
history = {}
if record.get("mlflow_run_id"):
    # Whatever loss terms the run's model reports (loss/<term>), not a fixed list: models are plugins.
    recorded = client.get_run(record["mlflow_run_id"]).data.metrics
    for key in sorted(k for k in recorded if k.startswith("loss/")):
        points = client.get_metric_history(record["mlflow_run_id"], key)
        history[key] = sorted((m.step, m.value) for m in points)
plot_loss_curve(history, snakemake.output.plot)
