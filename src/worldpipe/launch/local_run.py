"""The launcher's record of the config it composed, and single-process training in the launcher's own process.

The launcher composes and validates the config once per start and records it in RUN_DIR/hydra/config.yaml (with
the overrides beside it, as Hydra records a command line); torchrun's workers load that record
(:mod:`worldpipe.launch.worker`) instead of composing it again, so every rank trains exactly the config that was
checked, and only once.

torchrun buys nothing for one process (no process group is joined) but costs a fresh interpreter for itself and
one for the worker, each importing torch, so a single-process run calls :func:`worldpipe.trainer.main.train`
directly. ``WORLDPIPE_LAUNCHER=torchrun`` restores the torchrun path (for comparison: ``worldpipe bench startup``
measures both).
"""

from __future__ import annotations

import os
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from worldpipe.core.atomic import makedirs_durably, write_text_atomic
from worldpipe.tracking.connection import resolve_tracking_uri
from worldpipe.tracking.courier import start_early
from worldpipe.trainer.preemption import EXIT_PREEMPTED

LAUNCHER_ENV = "WORLDPIPE_LAUNCHER"
RECORD_DIR = "hydra"  # run_dir/hydra/{config,overrides}.yaml, logged with the run (worldpipe.tracking.records)


def runs_in_process(world_size: int, rdzv_endpoint: str | None) -> bool:
    """True for one process on one node, unless torchrun is asked for explicitly."""
    return world_size == 1 and rdzv_endpoint is None and os.environ.get(LAUNCHER_ENV, "auto") != "torchrun"


def record_config(cfg: DictConfig, overrides: list[str]) -> Path:
    """Write the config and the overrides it was composed with to RUN_DIR/hydra; returns the config's path."""
    record_dir = Path(cfg.run_dir) / RECORD_DIR
    makedirs_durably(record_dir)  # may make the run directory itself (a SLURM task without the run lock)
    plain = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]) if "hydra" in cfg else cfg
    path = record_dir / "config.yaml"
    write_text_atomic(path, OmegaConf.to_yaml(plain))
    write_text_atomic(record_dir / "overrides.yaml", OmegaConf.to_yaml(OmegaConf.create(list(overrides))))
    return path.resolve()


def start_courier_early(cfg: DictConfig) -> None:
    """Start the run's tracking courier now, before torch loads, in the process that will hold its recorder (the
    one-process launcher, or rank 0's torchrun worker): MLflow's import and store then overlap the trainer's
    start-up, and the run exists by the first checkpoint (which names it) instead of holding that checkpoint up."""
    if cfg.tracking.enabled:
        start_early(cfg.run_dir, resolve_tracking_uri(cfg.tracking.uri), cfg.tracking.system_metrics_interval_s,
                    cfg.tracking.system_metrics_samples_before_logging)


def run_in_process(cfg: DictConfig) -> int:
    """Train in this process; returns the exit status torchrun would have returned (0, or EXIT_PREEMPTED)."""
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(name, value)
    start_courier_early(cfg)
    # Imported only now: training brings torch (seconds); a refused launch never pays for it.
    from worldpipe.trainer.main import train

    try:
        train(cfg, checked=True)  # the launcher has validated it
    except SystemExit as stop:  # the trainer leaves with EXIT_PREEMPTED after checkpointing on a signal
        if stop.code == EXIT_PREEMPTED:
            return EXIT_PREEMPTED
        raise
    return 0
