"""Seeding of the process-global generators at the start of a run."""

from __future__ import annotations

import random

import numpy as np
import torch


def seed_rank_generators(seed: int, rank: int) -> None:
    """Identical torch init on every rank (replicas start equal); independent per-rank Python/NumPy streams."""
    torch.manual_seed(seed)
    random.seed(seed * 1000 + rank)
    np.random.seed((seed * 1000 + rank) % 2**32)
