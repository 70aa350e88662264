"""Run a single-process training in the launcher's own process: no torchrun, no rendezvous, no second import.

torchrun buys nothing for one process (no process group is joined) but costs a fresh interpreter for itself and
one for the worker, each importing torch. The launcher has already composed and validated the config, so it
calls :func:`worldpipe.trainer.main.train` directly. ``WORLDPIPE_LAUNCHER=torchrun`` restores the old path (for
comparison: ``worldpipe bench startup`` measures both).
"""

from __future__ import annotations

import os
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from worldpipe.core.atomic import write_text_atomic
from worldpipe.trainer.preemption import EXIT_PREEMPTED

LAUNCHER_ENV = "WORLDPIPE_LAUNCHER"


def runs_in_process(world_size: int, rdzv_endpoint: str | None) -> bool:
    """True for one process on one node, unless torchrun is asked for explicitly."""
    return world_size == 1 and rdzv_endpoint is None and os.environ.get(LAUNCHER_ENV, "auto") != "torchrun"


def run_in_process(cfg: DictConfig, overrides: list[str]) -> int:
    """Train in this process; returns the exit status torchrun would have returned (0, or EXIT_PREEMPTED)."""
    # Hydra's record of the command line, as the worker under torchrun would have written it (run_dir/hydra).
    hydra_dir = Path(cfg.run_dir) / "hydra"
    hydra_dir.mkdir(parents=True, exist_ok=True)
    plain = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]) if "hydra" in cfg else cfg
    write_text_atomic(hydra_dir / "config.yaml", OmegaConf.to_yaml(plain))
    write_text_atomic(hydra_dir / "overrides.yaml", OmegaConf.to_yaml(OmegaConf.create(list(overrides))))
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(name, value)
    # Imported only now: training brings torch (seconds); a refused launch never pays for it.
    from worldpipe.trainer.main import train

    try:
        train(cfg)
    except SystemExit as stop:  # the trainer leaves with EXIT_PREEMPTED after checkpointing on a signal
        if stop.code == EXIT_PREEMPTED:
            return EXIT_PREEMPTED
        raise
    return 0
