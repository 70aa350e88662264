"""Dataset specification: the complete, validated recipe for one trajectory dataset."""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from worldpipe.config.value import value_settings
from worldpipe.core.hashing import canonical_hash

# DeepMind Control suite tasks from state (shimmy's dm_control/<domain>-<task>-v0), with their action widths.
DMC_TASKS: dict[str, int] = {
    "dm_control/cartpole-swingup-v0": 1,
    "dm_control/cartpole-balance-v0": 1,
    "dm_control/pendulum-swingup-v0": 1,
    "dm_control/reacher-easy-v0": 2,
    "dm_control/finger-spin-v0": 2,
    "dm_control/cheetah-run-v0": 6,
    "dm_control/walker-walk-v0": 6,
}
SUPPORTED_ENVS: tuple[str, ...] = ("Pendulum-v1", "CartPole-v1", *DMC_TASKS)
# Envs whose actions are a continuous box: the ones a planner can act in (closed-loop control).
CONTINUOUS_ACTION_ENVS: tuple[str, ...] = ("Pendulum-v1", *DMC_TASKS)
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
    # Episodes collected by a trained model (a data-collection round), None for a scripted policy's episodes:
    # which run's model, the planner and exploration it acted with, and the dataset whose episodes come first.
    # See :func:`check_collector`; the keys are part of the spec, so of its hash.
    collector: dict | None = None
    # Each decision's action held for this many control steps of the env (rewards summed): DeepMind Control's usual
    # setting. Left out of to_dict() at 1, so a spec without it has the hash it had before it existed.
    action_repeat: int = 1
    # A dict observation (DeepMind Control) flattened in this key order: recorded in the spec, so in the dataset's
    # hash and manifest. None for a flat observation (left out of to_dict()).
    observation_keys: list | None = None

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
        object.__setattr__(self, "action_repeat", _check_int("action_repeat", self.action_repeat, 1))
        if self.observation_keys is not None:
            keys = self.observation_keys
            if isinstance(keys, str | bytes) or not all(isinstance(k, str) and k for k in keys) or not keys:
                raise ValueError(f"dataset spec key 'observation_keys' must be a non-empty list of key names, "
                                 f"got {keys!r}")
            object.__setattr__(self, "observation_keys", [str(k) for k in keys])
        if self.pixels and self.env_id in DMC_TASKS:
            raise ValueError(f"dataset spec key 'pixels': {self.env_id} is collected from state (pixels: false)")
        if self.collector is not None:
            object.__setattr__(self, "collector", check_collector(self.collector, self))

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
        """Plain JSON-serialisable dict; from_dict(to_dict()) round-trips. A scripted policy's spec has no
        ``collector`` key, and a spec at the default action repeat and flat observations no ``action_repeat`` or
        ``observation_keys`` (so its hash is what it was before those existed)."""
        out = dataclasses.asdict(self)
        for key, default in (("collector", None), ("action_repeat", 1), ("observation_keys", None)):
            if out[key] == default:
                del out[key]
        return out

    @property
    def env_options(self) -> dict:
        """How the env is made beyond its id (``make_env``'s keywords): action repeat and observation key order."""
        return {"action_repeat": self.action_repeat, "observation_keys": self.observation_keys}

    @property
    def copied_episodes(self) -> int:
        """Episodes [0, n) copied from the collector's ``parent`` dataset; the rest are collected (0: none)."""
        return int(self.collector["copied_episodes"]) if self.collector else 0

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


# What a collected dataset's spec says about its collection (worldpipe.control.collection reads it).
COLLECTOR_KEYS: dict[str, type | tuple[type, ...]] = {
    "round": int,             # this dataset is round k >= 1 of a collect-train loop
    "base": str,              # the round-0 dataset (the scripted policy's), whose held-out sibling evaluates every round
    "experiment": str,        # the collecting run: runs/<experiment>/<run_hash>/, its final checkpoint
    "run_hash": str,
    "parent": dict,           # {name, spec_hash}: the dataset the collecting run trained on
    "copied_episodes": int,   # episodes [0, n) copied from the parent (n = its episodes: the union of rounds)
    "planner": dict,          # the planner's full config, with its _target_
    "context": int,           # observed steps the model filters before each decision
    "exploration_std": (int, float),  # Gaussian noise on each action, as a fraction of the action box's half-width
}
# Present only where used, so that every spec without it keeps its hash.
OPTIONAL_COLLECTOR_KEYS: dict[str, type] = {
    "novelty": dict,  # {weight, reference}: a bonus for imagined observations far from the collecting run's data
    "value": dict,    # every ValueSettings field: the collecting planner's terminal value, fitted through the model
}


def check_collector(collector: Any, spec: DatasetSpec) -> dict:
    """A collected dataset's ``collector`` block, checked (ValueError names the key): plain JSON values only."""
    if not isinstance(collector, Mapping):
        raise ValueError(f"dataset spec key 'collector' must be a mapping, got {collector!r}")
    keys = sorted(str(k) for k in collector)
    if sorted(set(keys) - set(OPTIONAL_COLLECTOR_KEYS)) != sorted(COLLECTOR_KEYS):
        raise ValueError(f"dataset spec key 'collector' must have the keys {sorted(COLLECTOR_KEYS)} (and may have "
                         f"{sorted(OPTIONAL_COLLECTOR_KEYS)}), got {keys}")
    for key, kind in (COLLECTOR_KEYS | OPTIONAL_COLLECTOR_KEYS).items():
        if key not in collector:  # an optional key left out (the required ones are all there)
            continue
        value = collector[key]
        if isinstance(value, bool) or not isinstance(value, kind):
            raise ValueError(f"dataset spec key 'collector.{key}' has the wrong type: {value!r}")
    if "novelty" in collector:
        check_novelty(collector["novelty"])
    if "value" in collector and value_settings(collector["value"], "dataset spec key 'collector.value'") != dict(
            collector["value"]):
        raise ValueError("dataset spec key 'collector.value' must list every value setting (as the pipeline writes "
                         f"it), got {dict(collector['value'])!r}")
    if collector["round"] < 1 or collector["context"] < 1 or collector["exploration_std"] < 0:
        raise ValueError("dataset spec key 'collector': round and context must be >= 1, exploration_std >= 0")
    if not 0 <= collector["copied_episodes"] < spec.episodes:
        raise ValueError(f"dataset spec key 'collector.copied_episodes' must be in [0, episodes={spec.episodes}), "
                         f"got {collector['copied_episodes']}")
    if spec.pixels:
        raise ValueError("dataset spec key 'collector': collection rounds act on state observations (pixels: false)")
    return json.loads(json.dumps(dict(collector), sort_keys=True))


def check_novelty(novelty: Mapping[str, Any]) -> None:
    """A collector's ``novelty`` block: ``weight`` > 0 (a number) and ``reference`` >= 1 observations (ValueError)."""
    weight, reference = novelty.get("weight"), novelty.get("reference")
    if (sorted(novelty) != ["reference", "weight"] or isinstance(weight, bool) or not isinstance(weight, int | float)
            or weight <= 0 or isinstance(reference, bool) or not isinstance(reference, int) or reference < 1):
        raise ValueError("dataset spec key 'collector.novelty' must be {weight: a number > 0, reference: an integer "
                         f">= 1}}, got {dict(novelty)!r}")


def spec_hash(spec: Mapping[str, Any]) -> str:
    """The hash that addresses a dataset spec (``results/data/<name>/<spec-hash>``, and every run trained on it):
    of the normalized spec, so a default written out and a default left out give the same hash."""
    return canonical_hash(DatasetSpec.from_dict(spec).to_dict())
