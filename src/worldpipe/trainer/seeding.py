"""Seeding of the process-global generators at the start of a run."""

from __future__ import annotations

import random

import numpy as np
import torch

from worldpipe.checkpoint.state import NUMPY_GLOBAL_STREAM, PYTHON_STREAM

# The streams seeded differently on every rank below; torch's global generator is seeded identically on purpose
# (the same model init everywhere), so it is not one of them. `worldpipe ckpt verify --rng` checks this policy.
PER_RANK_STREAMS = (PYTHON_STREAM, NUMPY_GLOBAL_STREAM)


def seed_rank_generators(seed: int, rank: int) -> None:
    """Identical torch init on every rank (replicas start equal); independent per-rank Python/NumPy streams."""
    torch.manual_seed(seed)
    random.seed(seed * 1000 + rank)
    np.random.seed((seed * 1000 + rank) % 2**32)
