"""Seeding of the process-global generators at the start of a run, and a trace of their states per step."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import numpy as np
import torch

from worldpipe.checkpoint.state import NUMPY_GLOBAL_STREAM, PYTHON_STREAM, capture_rng, rng_fingerprint

# Debugging aid: with WORLDPIPE_RNG_TRACE=<dir> set, every training step appends one JSON line to
# <dir>/rank-NNNNN.jsonl (process id, fingerprint of the global generator states the forward is about to draw
# from), so a test can compare the states a resumed rank draws from with the ones that rank saved.
RNG_TRACE_ENV = "WORLDPIPE_RNG_TRACE"
RNG_TRACE_FORMAT = "rank-{rank:05d}.jsonl"

# The streams seeded differently on every rank below; torch's global generator is seeded identically on purpose
# (the same model init everywhere), so it is not one of them. `worldpipe ckpt verify --rng` checks this policy.
PER_RANK_STREAMS = (PYTHON_STREAM, NUMPY_GLOBAL_STREAM)


def seed_rank_generators(seed: int, rank: int) -> None:
    """Identical torch init on every rank (replicas start equal); independent per-rank Python/NumPy streams."""
    torch.manual_seed(seed)
    random.seed(seed * 1000 + rank)
    np.random.seed((seed * 1000 + rank) % 2**32)


class RngTrace:
    """Appends this rank's global generator fingerprints, one line per training step (``WORLDPIPE_RNG_TRACE``)."""

    def __init__(self, directory: str, rank: int) -> None:
        self.path = Path(directory) / RNG_TRACE_FORMAT.format(rank=rank)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    @classmethod
    def from_env(cls, rank: int) -> RngTrace | None:
        """A trace when ``WORLDPIPE_RNG_TRACE`` names a directory, else None."""
        directory = os.environ.get(RNG_TRACE_ENV)
        return cls(directory, rank) if directory else None

    def record(self) -> None:
        """Append the fingerprint of the global generators as they are now."""
        line = json.dumps({"pid": os.getpid(), "rng": rng_fingerprint(capture_rng())}, sort_keys=True)
        with open(self.path, "a") as out:
            out.write(line + "\n")
