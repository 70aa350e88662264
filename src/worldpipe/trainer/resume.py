"""Resuming a run: which checkpoint, and whether it belongs to this config and dataset."""

from __future__ import annotations

import logging

from omegaconf import DictConfig

from worldpipe.checkpoint import CheckpointManager
from worldpipe.config.identity import config_diff, identity_config
from worldpipe.core.errors import UsageError
from worldpipe.data.manifest import load_manifest

log = logging.getLogger("worldpipe.trainer.main")


class ResumeRefused(UsageError, RuntimeError):
    """The checkpoint on disk belongs to a different run (config or dataset changed)."""


def check_resume_identity(saved: dict, cfg: DictConfig, dataset_hash: str, step: int) -> None:
    """Refuse to resume a checkpoint written by a different config (beyond safe keys) or dataset."""
    if saved["dataset_hash"] != dataset_hash:
        raise ResumeRefused(
            f"checkpoint step {step} was trained on dataset {saved['dataset_hash'][:16]}…, "
            f"but data.manifest now has {dataset_hash[:16]}…; use a new run_dir or the original data"
        )
    old = identity_config(saved["config"])
    new = identity_config(cfg)
    diff = config_diff(old, new)
    if diff and not cfg.checkpoint.allow_config_change:
        raise ResumeRefused(
            f"checkpoint step {step} was written with a different config:\n"
            + "\n".join(diff)
            + "\nresume with the original values, or pass checkpoint.allow_config_change=true to accept them"
        )
    if diff:
        log.warning("resuming step %d with changed config (allowed):\n%s", step, "\n".join(diff))


def preflight_resume(cfg: DictConfig) -> int | None:
    """Before any process starts: the step a run would resume from, after the identity check."""
    # Sizes only and the identity file only: the ranks verify and load the full state themselves.
    manager = CheckpointManager(cfg.checkpoint.dir, keep_last=cfg.checkpoint.keep_last, verify="size")
    step = manager.latest_intact()
    if step is not None:
        identity = manager.load(step, keys=["identity"])["identity"]
        check_resume_identity(identity, cfg, load_manifest(cfg.data.manifest)["dataset_hash"], step)
    return step
