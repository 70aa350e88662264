"""Train a world model: `train(cfg)` is a plain function; `train_recorded(path)` the body of a torchrun worker
started by `worldpipe train` (the launcher's recorded config), `main()` the thin Hydra entry point for runs
started by hand. The steps themselves live in :class:`worldpipe.trainer.trainer.Trainer`.
"""

from __future__ import annotations

import logging
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from worldpipe.config.paths import CONF_DIR
from worldpipe.core.errors import ERROR_LOG, run_worker_main
from worldpipe.measure.startup import mark
from worldpipe.parallel.runtime import init_runtime, shutdown_runtime, world_size_from_env
from worldpipe.trainer.trainer import Trainer
from worldpipe.trainer.validation import validate_config

log = logging.getLogger("worldpipe.trainer.main")
mark("train_imported")
LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s: %(message)s"


def train(cfg: DictConfig, checked: bool = False) -> dict:
    """Train (or resume) the run described by `cfg`; returns the completion record.

    ``checked``: the launcher has validated `cfg` for this world size already (once per start is enough).
    """
    if not checked:
        validate_config(cfg, world_size_from_env())
    mark("train_start")
    runtime = init_runtime(cfg.parallel.backend)
    mark("process_group_ready")
    try:
        return Trainer(cfg, runtime).fit()
    finally:
        shutdown_runtime()


def train_recorded(path: str | Path) -> None:
    """Train the config the launcher composed, validated and recorded (a torchrun worker's body).

    Any error ends as one line on stderr and a non-zero exit; its traceback goes to RUN_DIR/errors.log.
    """
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    cfg = OmegaConf.load(path)
    OmegaConf.set_struct(cfg, True)  # as Hydra hands it over: a misspelt key is an error, not None
    run_worker_main(lambda: train(cfg, checked=True), lambda: Path(cfg.run_dir) / ERROR_LOG)


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    """Hydra entry point (`python -m worldpipe.trainer.main key=value ...`, usually under torchrun).

    Any error ends as one line on stderr and a non-zero exit; its traceback goes to RUN_DIR/errors.log.
    """
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    run_worker_main(lambda: train(cfg), lambda: Path(cfg.run_dir) / ERROR_LOG)


if __name__ == "__main__":
    main()
