"""Train a world model: `train(cfg)` is a plain function, `main()` the thin Hydra entry point.

Launched under torchrun (one process per rank) by `worldpipe train` or the Snakemake rule `train_model`; the
steps themselves live in :class:`worldpipe.trainer.trainer.Trainer`.
"""

from __future__ import annotations

import logging
from pathlib import Path

import hydra
from omegaconf import DictConfig

from worldpipe.config.paths import CONF_DIR
from worldpipe.core.errors import ERROR_LOG, run_worker_main
from worldpipe.measure.startup import mark
from worldpipe.parallel.runtime import init_runtime, shutdown_runtime, world_size_from_env
from worldpipe.trainer.trainer import Trainer
from worldpipe.trainer.validation import validate_config

log = logging.getLogger("worldpipe.trainer.main")
mark("train_imported")

def train(cfg: DictConfig) -> dict:
    """Train (or resume) the run described by `cfg`; returns the completion record."""
    validate_config(cfg, world_size_from_env())
    mark("train_start")
    runtime = init_runtime(cfg.parallel.backend)
    mark("process_group_ready")
    try:
        return Trainer(cfg, runtime).fit()
    finally:
        shutdown_runtime()


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    """Hydra entry point (`python -m worldpipe.trainer.main key=value ...`, usually under torchrun).

    Any error ends as one line on stderr and a non-zero exit; its traceback goes to RUN_DIR/errors.log.
    """
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    run_worker_main(lambda: train(cfg), lambda: Path(cfg.run_dir) / ERROR_LOG)


if __name__ == "__main__":
    main()
