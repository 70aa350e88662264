"""Demo checkpoints: a model published exactly as training publishes one, without training it.

For the rollout benchmark on a fresh clone and for fast service tests; a trained checkpoint is served the
same way. The identity records the model config (how to build it) and its sizes.
"""

from __future__ import annotations

from pathlib import Path

import torch
from omegaconf import OmegaConf

from worldpipe.checkpoint import CheckpointManager
from worldpipe.config.compose import compose_config
from worldpipe.core.provenance import PROJECT_ROOT
from worldpipe.models import build_model

MODEL_CONF_DIR = PROJECT_ROOT / "conf" / "model"
SMALL_RSSM = {"_target_": "worldpipe.models.rssm.RSSM", "embed": 16, "deter": 16, "stoch": 4, "hidden": 32}


def model_config(name: str) -> dict:
    """The model config ``conf/model/NAME.yaml`` as a plain dict, composed by Hydra as training composes it.

    Composed, not read: a model file may have a defaults list (the augmented RSSM nests ``rssm@inner``).
    """
    return OmegaConf.to_container(compose_config([f"model={name}"]).model, resolve=True)


def publish_demo_checkpoint(root: str | Path, step: int = 1, seed: int = 0, model_cfg: dict | None = None,
                            obs_dim: int = 3, act_dim: int = 1, config: dict | None = None) -> None:
    """Publish checkpoint ``step`` under ``root`` holding a freshly initialized model (seeded); ``config``: more
    of the recorded run config (``data.manifest``: the dataset the model stands for)."""
    model_cfg = dict(model_cfg or SMALL_RSSM)
    torch.manual_seed(seed)
    model = build_model(model_cfg, obs_dim, act_dim)
    model.set_normalization(torch.linspace(-0.5, 0.5, obs_dim), torch.linspace(0.5, 2.0, obs_dim))
    state = {
        "model": model.state_dict(), "optimizer": None, "scheduler": None, "scaler": None, "ema": None,
        "progress": {"step": step, "epoch": 0, "samples_seen": 0, "tokens_seen": 0},
        "sampler": {"seed": seed, "epoch": 0, "cursor": 0}, "rng": [],
        "identity": {"config": {**(config or {}), "model": model_cfg, "seed": seed}, "demo": True,
                     "dims": {"obs_dim": obs_dim, "act_dim": act_dim}},
    }
    with CheckpointManager(root) as manager:
        manager.save(step, state)
