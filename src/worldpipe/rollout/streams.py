"""Named RNG streams for imagined latents: the noise of step k is a function of (seed, stream id, k) only.

A rollout draws the noise of its k-th imagined step from a generator seeded by hashing (seed, stream, k), so
the draw does not depend on which other requests share the batch, on how a trajectory was split into session
extensions, or on the process that serves it: the same stream gives bit-identical latents across server
restarts. A fresh sample is a new stream id (:func:`fresh_stream`), never a replay of an existing one.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass

import torch

_DOMAIN = b"worldpipe-rollout-noise-v1\0"
FRESH_PREFIX = "fresh-"


@dataclass(frozen=True)
class StreamId:
    """Identity of a noise stream: the seed and a client-chosen (or server-minted) stream name."""

    seed: int
    stream: str

    def key(self) -> str:
        """Canonical text form used in cache keys."""
        return f"{self.seed}:{self.stream}"


def fresh_stream(seed: int) -> StreamId:
    """A stream no earlier request can have used: 128 random bits from the OS."""
    return StreamId(seed, FRESH_PREFIX + secrets.token_hex(16))


def _step_seed(stream: StreamId, step: int) -> int:
    digest = hashlib.sha256(_DOMAIN + f"{stream.seed}\0{stream.stream}\0{step}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # torch seeds must fit in a signed 64-bit int


def seed_for_step(stream: StreamId, step: int, generator: torch.Generator) -> torch.Generator:
    """``generator`` reseeded for step ``step`` of ``stream`` (its draws are a function of the two only)."""
    return generator.manual_seed(_step_seed(stream, step))


def step_noise(stream: StreamId, step: int, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """Standard-normal noise of imagined step ``step`` (0 = first step after the context) of ``stream``."""
    return torch.randn(*shape, generator=seed_for_step(stream, step, generator))
