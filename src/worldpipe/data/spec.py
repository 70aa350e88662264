"""Dataset specification: the complete, validated recipe for one trajectory dataset."""

from __future__ import annotations

import dataclasses
import math
import numbers
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from worldpipe.core.hashing import canonical_hash

SUPPORTED_ENVS: tuple[str, ...] = ("Pendulum-v1", "CartPole-v1")
# Envs whose actions are a continuous box: the ones a planner can act in (closed-loop control).
CONTINUOUS_ACTION_ENVS: tuple[str, ...] = ("Pendulum-v1",)
SUPPORTED_POLICIES: tuple[str, ...] = ("random", "noisy_controller")
SUPPORTED_COMPRESSORS: tuple[str, ...] = ("zstd", "none")

# The name ends up in paths (results/data/<name>/) and Snakemake wildcards, so keep it boring.
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_PIXEL_SIZE_RANGE = (8, 256)


def _check_int(key: str, value: Any, minimum: int) -> int:
    # bool is an Integral subclass; True as an episode count is almost certainly a config mistake.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"dataset spec key {key!r} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"dataset spec key {key!r} must be >= {minimum}, got {value!r}")
    return int(value)


def _check_choice(key: str, value: Any, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(
            f"dataset spec key {key!r} has unsupported value {value!r}; expected one of {list(choices)}"
        )
    return value


@dataclass(frozen=True)
class DatasetSpec:
    """What to simulate and how to store it. Equal specs produce byte-identical stores."""

    name: str
    env_id: str
    policy: str
    episodes: int
    max_steps: int
    episodes_per_shard: int
    seed: int
    pixels: bool = False
    pixel_size: int = 32
    compressor: str = "zstd"

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME_RE.match(self.name):
            raise ValueError(
                f"dataset spec key 'name' must match {_NAME_RE.pattern} (used in paths), got {self.name!r}"
            )
        _check_choice("env_id", self.env_id, SUPPORTED_ENVS)
        _check_choice("policy", self.policy, SUPPORTED_POLICIES)
        _check_choice("compressor", self.compressor, SUPPORTED_COMPRESSORS)
        # Normalise numpy / omegaconf integers to plain ints so to_dict() is JSON-clean.
        for key, minimum in (("episodes", 1), ("max_steps", 1), ("episodes_per_shard", 1), ("seed", 0)):
            object.__setattr__(self, key, _check_int(key, getattr(self, key), minimum))
        size = _check_int("pixel_size", self.pixel_size, _PIXEL_SIZE_RANGE[0])
        if size > _PIXEL_SIZE_RANGE[1]:
            raise ValueError(f"dataset spec key 'pixel_size' must be <= {_PIXEL_SIZE_RANGE[1]}, got {size}")
        object.__setattr__(self, "pixel_size", size)
        if not isinstance(self.pixels, bool):
            raise ValueError(f"dataset spec key 'pixels' must be a boolean, got {self.pixels!r}")

    @classmethod
    def from_dict(cls, d: Mapping) -> DatasetSpec:
        """Build a spec from a mapping (YAML / Hydra config); ValueError names any bad key or value."""
        if not isinstance(d, Mapping):
            raise ValueError(f"dataset spec must be a mapping, got {type(d).__name__}")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(str(k) for k in d if k not in fields)
        if unknown:
            raise ValueError(f"unknown dataset spec key(s) {unknown}; allowed keys: {sorted(fields)}")
        required = [
            name
            for name, f in fields.items()
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        ]
        missing = [k for k in required if k not in d]
        if missing:
            raise ValueError(f"missing required dataset spec key(s) {missing}")
        return cls(**{str(k): d[k] for k in d})

    def to_dict(self) -> dict:
        """Plain JSON-serialisable dict; from_dict(to_dict()) round-trips."""
        return dataclasses.asdict(self)

    @property
    def num_shards(self) -> int:
        """Number of shard files per array: ceil(episodes / episodes_per_shard)."""
        return math.ceil(self.episodes / self.episodes_per_shard)

    def shard_range(self, shard_index: int) -> tuple[int, int]:
        """Episode range [start, stop) stored in shard ``shard_index``."""
        if not 0 <= shard_index < self.num_shards:
            raise ValueError(f"shard index {shard_index} out of range [0, {self.num_shards})")
        start = shard_index * self.episodes_per_shard
        return start, min(start + self.episodes_per_shard, self.episodes)


def spec_hash(spec: Mapping[str, Any]) -> str:
    """The hash that addresses a dataset spec (``results/data/<name>/<spec-hash>``, and every run trained on it):
    of the normalized spec, so a default written out and a default left out give the same hash."""
    return canonical_hash(DatasetSpec.from_dict(spec).to_dict())
