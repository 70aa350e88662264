"""A smoke training tracked into an MLflow SQLite store, as the tracking crash tests run it (kill -9 at random,
power cuts), and the one run such a store holds."""

from __future__ import annotations

from pathlib import Path

from mlflow.tracking import MlflowClient

STEPS, EVERY, LOG_EVERY = 30, 10, 5


def train_cmd(run_dir: Path, dataset, db: Path) -> list[str]:
    """`worldpipe train` of the smoke experiment (2 ranks) into RUN_DIR, tracked into the SQLite store ``db``."""
    store, manifest = dataset
    return ["worldpipe", "train", "experiment=smoke", f"run_dir={run_dir}", f"data.store={store}",
            f"data.manifest={manifest}", f"tracking.uri=sqlite:///{db}", "trainer.progress_bar=false",
            f"trainer.steps={STEPS}", f"checkpoint.every={EVERY}", f"trainer.log_every={LOG_EVERY}"]


def only_run(db: Path):
    """The single run recorded in ``db`` (fails if there are several) and a client for it."""
    client = MlflowClient(f"sqlite:///{db}")
    experiments = client.search_experiments()
    runs = [r for e in experiments for r in client.search_runs([e.experiment_id])]
    assert len(runs) == 1, [r.info.run_id for r in runs]
    return client, runs[0]
