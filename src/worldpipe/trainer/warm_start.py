"""Warm start: a run that begins from another finished run's final weights (``init_from``).

``init_from: <experiment>/<run-hash>`` (a root key, given only where it is used: ``+init_from=...``, so every
config without it keeps its hash) names the run by its address under ``paths.runs``, never by an absolute path:
moving the checkout changes no identity. Only the model's parameters and buffers are taken; the optimizer, the
schedule and the sampler start fresh, and the normalisation is the new run's data's (set after loading). The
weights' checkpoint digest is checked against the finished run's completion record and recorded in the new run's
identity, so a warm-started run says exactly which bits it started from.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from worldpipe.checkpoint import CheckpointManager, state_digest
from worldpipe.config import paths
from worldpipe.config.identity import ConfigError

KEY = "init_from"


def init_run_dir(cfg: DictConfig) -> str | None:
    """The run directory ``init_from`` names (None where the config has no warm start)."""
    value = cfg.get(KEY)
    if value in (None, ""):
        return None
    parts = str(value).split("/")
    if len(parts) != 2 or not all(parts):
        raise ConfigError(f"config key '{KEY}': {value!r} is not '<experiment>/<run-hash>' (a run under "
                          f"{cfg.paths.runs}/)")
    return f"{cfg.paths.runs}/{parts[0]}/{paths.short(parts[1])}"


def warm_start_state(cfg: DictConfig) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """(model state, record) of the finished run ``init_from`` names; None without one. ConfigError (one line)
    where that run has not finished or its final checkpoint no longer has the digest its completion record holds."""
    run_dir = init_run_dir(cfg)
    if run_dir is None:
        return None
    done = Path(run_dir) / paths.COMPLETION_RECORD
    if not done.is_file():
        raise ConfigError(f"config key '{KEY}': {run_dir} has not finished training ({done} is missing); train it "
                          "first (a rounds pipeline trains round k-1 before round k)")
    record = json.loads(done.read_text())
    step = int(record["final_step"])
    state = CheckpointManager(paths.checkpoints_dir(run_dir)).load(step)
    digest = state_digest(state)
    if digest != record["digest"]:
        raise ConfigError(f"config key '{KEY}': {run_dir} step {step} has digest {digest[:16]}…, its completion "
                          f"record says {record['digest'][:16]}…: the run was changed after it finished")
    return state["model"], {"run_dir": run_dir, "step": step, "digest": digest,
                            "mlflow_run_id": record.get("mlflow_run_id")}
