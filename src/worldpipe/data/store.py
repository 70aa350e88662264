"""Zarr v3 trajectory store: one group per dataset, one chunk per episode, one shard file per
``episodes_per_shard`` episodes and array.

Layout (E episodes, T = max_steps; padding beyond an episode's length is zeros)::

    obs [E, T, obs_dim] f32   action [E, T, act_dim] f32   reward [E, T] f32   terminated [E, T] bool
    length [E] int32          pixels [E, T, H, W, 3] uint8 (only when spec.pixels)
"""

from __future__ import annotations

import asyncio
import glob
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import zarr
from tqdm import tqdm
from zarr.abc.store import Store
from zarr.codecs import ZstdCodec
from zarr.core.buffer import default_buffer_prototype
from zarr.core.sync import sync
from zarr.storage import FsspecStore, LocalStore

import worldpipe
from worldpipe.core.errors import EXIT_USAGE, UserError
from worldpipe.core.locations import local_path
from worldpipe.data.environments import env_dims
from worldpipe.data.episodes import Episode, simulate_episode
from worldpipe.data.integrity import CorruptShardError, VerifyingStore
from worldpipe.data.shard_codec import ShardFormat
from worldpipe.data.spec import DatasetSpec

__all__ = ["CorruptShardError", "TrajectoryStore", "init_store", "write_shards", "array_layout"]

STORE_FORMAT = "worldpipe.trajectories/1"
_ZSTD_LEVEL = 3
_STD_FLOOR = 1e-6


class StoreNotFoundError(UserError, FileNotFoundError):
    """No trajectory store where one was named: the message names the path (exit 2: the path must change)."""

    exit_code = EXIT_USAGE


def open_zarr_store(url: str, *, read_only: bool, storage_options: dict[str, Any] | None = None) -> Store:
    """A zarr store rooted at ``url``.

    Local paths use zarr's LocalStore, whose writes go through a temp file + rename, so a killed writer
    never leaves a half-written shard under its final name. Everything else goes through fsspec
    (``memory://``, ``s3://`` ...); ``storage_options`` are passed to the filesystem (e.g. an S3 endpoint).
    """
    path = local_path(url)
    if path is not None:
        if read_only and not os.path.isdir(path):
            raise StoreNotFoundError(f"no trajectory store at {url!r} (no such directory)")
        return LocalStore(os.path.abspath(path), read_only=read_only)
    return FsspecStore.from_url(url, storage_options=dict(storage_options or {}), read_only=read_only)


@dataclass(frozen=True)
class ArrayLayout:
    """Shape, dtype, chunking and names of one store array."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    dimension_names: tuple[str, ...]

    @property
    def chunks(self) -> tuple[int, ...]:
        return (1, *self.shape[1:])

    def shards(self, episodes_per_shard: int) -> tuple[int, ...]:
        return (episodes_per_shard, *self.shape[1:])

    def shard_key(self, shard_index: int) -> str:
        """Store key of this array's shard file ``shard_index`` (default v3 chunk key encoding)."""
        return "/".join([self.name, "c", str(shard_index)] + ["0"] * (len(self.shape) - 1))


def array_layout(spec: DatasetSpec) -> list[ArrayLayout]:
    """The arrays a store for ``spec`` holds, in a fixed order."""
    dims = env_dims(spec.env_id)
    e, t = spec.episodes, spec.max_steps
    layout = [
        ArrayLayout("obs", (e, t, dims.obs_dim), "float32", ("episode", "step", "obs_dim")),
        ArrayLayout("action", (e, t, dims.act_dim), "float32", ("episode", "step", "act_dim")),
        ArrayLayout("reward", (e, t), "float32", ("episode", "step")),
        ArrayLayout("terminated", (e, t), "bool", ("episode", "step")),
        ArrayLayout("length", (e,), "int32", ("episode",)),
    ]
    if spec.pixels:
        size = spec.pixel_size
        layout.append(
            ArrayLayout(
                "pixels", (e, t, size, size, 3), "uint8", ("episode", "step", "height", "width", "channel")
            )
        )
    return layout


def generator_versions(spec: DatasetSpec) -> dict[str, str]:
    """Versions of everything whose behaviour determines the stored bytes."""
    import gymnasium

    versions = {
        "worldpipe": worldpipe.__version__,
        "gymnasium": gymnasium.__version__,
        "numpy": np.__version__,
        "zarr": zarr.__version__,
    }
    if spec.pixels:
        import pygame

        versions["pygame"] = pygame.version.ver
    if spec.env_id.startswith("dm_control/"):  # DeepMind Control: the physics and the task code decide the bytes
        from importlib.metadata import version

        versions.update({name: version(name) for name in ("dm_control", "mujoco", "shimmy")})
    return versions


def _refuse_foreign_directory(url: str) -> None:
    # Re-initialising wipes the store; make sure a typo cannot wipe an unrelated directory.
    path = local_path(url)
    foreign = (
        path is not None
        and os.path.isdir(path)
        and bool(os.listdir(path))
        and not os.path.exists(os.path.join(path, "zarr.json"))
    )
    if foreign:
        raise ValueError(f"refusing to initialise a store in non-empty non-zarr directory {path!r}")


def init_store(url: str, spec: DatasetSpec, storage_options: dict[str, Any] | None = None,
               lineage: dict | None = None) -> None:
    """Create the dataset group and its (empty) arrays at ``url``; metadata only, deterministic.

    Anything already stored at ``url`` is removed: a store always belongs to exactly one spec. A
    non-empty local directory that is not a zarr store is refused. ``lineage``: where a collected dataset's
    episodes come from (the collecting checkpoint's digest, its MLflow run, the parent dataset's hash), kept in
    the store's attributes and copied into its manifest when it is sealed.
    """
    _refuse_foreign_directory(url)
    store = open_zarr_store(url, read_only=False, storage_options=storage_options)
    dims = env_dims(spec.env_id)
    attrs = {
        "worldpipe": {
            "format": STORE_FORMAT,
            "spec": spec.to_dict(),
            "obs_dim": dims.obs_dim,
            "act_dim": dims.act_dim,
            "versions": generator_versions(spec),
        }
    }
    if lineage is not None:
        attrs["worldpipe"]["lineage"] = lineage
    group = zarr.create_group(store, overwrite=True, attributes=attrs, zarr_format=3)
    compressors = [ZstdCodec(level=_ZSTD_LEVEL, checksum=False)] if spec.compressor == "zstd" else None
    for arr in array_layout(spec):
        group.create_array(
            arr.name,
            shape=arr.shape,
            dtype=arr.dtype,
            chunks=arr.chunks,
            shards=arr.shards(spec.episodes_per_shard),
            compressors=compressors,
            filters=None,
            fill_value=False if arr.dtype == "bool" else 0,
            dimension_names=arr.dimension_names,
        )


def _stored_spec(group: zarr.Group, url: str) -> DatasetSpec:
    meta = group.attrs.get("worldpipe")
    if not isinstance(meta, dict) or meta.get("format") != STORE_FORMAT:
        raise ValueError(f"{url!r} is not a worldpipe trajectory store (missing/unknown 'worldpipe' attrs)")
    return DatasetSpec.from_dict(meta["spec"])


def _remove_stale_shard(store: Any, url: str, key: str) -> None:
    # zarr merges a write into an existing shard file (read-modify-write). Removing our own shard first
    # makes the write independent of whatever a killed earlier attempt left, including its temp files.
    sync(store.delete(key))
    root = local_path(url)
    if root is not None:
        for leftover in glob.glob(glob.escape(os.path.join(root, key)) + ".*.partial"):
            os.remove(leftover)


class ShardWriter:
    """Writes whole shards of an initialised store, each from its episodes in index order.

    Touches only the shards it is given, so disjoint writers may run in parallel processes; a shard's bytes
    depend only on its episodes, not on which writer wrote it.
    """

    def __init__(self, url: str, spec: DatasetSpec, storage_options: dict[str, Any] | None = None) -> None:
        self.url, self.spec = url, spec
        self.store = open_zarr_store(url, read_only=False, storage_options=storage_options)
        group = zarr.open_group(self.store, mode="r+", zarr_format=3)
        stored = _stored_spec(group, url)
        if stored != spec:
            raise ValueError(f"store {url!r} was initialised for a different spec: {stored} != {spec}")
        self.layout = array_layout(spec)
        # Runtime option, not metadata: keep all-zero chunks (e.g. Pendulum's never-terminated flags) so every
        # shard file exists and the manifest can tell "missing" from "empty".
        self.arrays = {a.name: group[a.name].with_config({"write_empty_chunks": True}) for a in self.layout}

    def shard_files(self, shard_index: int) -> list[str]:
        """The store-relative keys of one shard's files, one per array."""
        return [a.shard_key(shard_index) for a in self.layout]

    def write(self, shard_index: int, episodes: Iterable[Episode]) -> dict:
        """Write shard ``shard_index`` from its episodes (``spec.shard_range`` of them, in order); its record."""
        start, stop = self.spec.shard_range(shard_index)
        buffers = {a.name: np.zeros((stop - start, *a.shape[1:]), a.dtype) for a in self.layout}
        count = 0
        for i, ep in enumerate(episodes):
            n = len(ep)
            buffers["obs"][i, :n] = ep.obs
            buffers["action"][i, :n] = ep.action
            buffers["reward"][i, :n] = ep.reward
            buffers["terminated"][i, :n] = ep.terminated
            buffers["length"][i] = n
            if ep.pixels is not None:
                buffers["pixels"][i, :n] = ep.pixels
            count += 1
        if count != stop - start:
            raise ValueError(f"shard {shard_index} holds episodes [{start}, {stop}), got {count}")
        for a in self.layout:
            _remove_stale_shard(self.store, self.url, a.shard_key(shard_index))
            self.arrays[a.name][start:stop] = buffers[a.name]
        return {"index": shard_index, "episodes": stop - start, "steps": int(buffers["length"].sum()),
                "first_episode": start}


def write_shards(
    url: str,
    spec: DatasetSpec,
    shard_indices: Iterable[int],
    progress: bool = True,
    storage_options: dict[str, Any] | None = None,
) -> list[dict]:
    """Simulate and write the episodes of ``shard_indices`` with the spec's policy; one record per shard."""
    writer = ShardWriter(url, spec, storage_options)
    indices = list(dict.fromkeys(int(i) for i in shard_indices))
    for s in indices:
        spec.shard_range(s)  # validates before any work is done
    total = sum(spec.shard_range(s)[1] - spec.shard_range(s)[0] for s in indices)
    records = []
    with tqdm(total=total, desc=f"simulate {spec.name}", unit="ep", disable=not progress) as bar:
        for s in indices:
            def simulated(s=s):
                for episode_index in range(*spec.shard_range(s)):
                    yield simulate_episode(spec, episode_index)
                    bar.update(1)
            records.append(writer.write(s, simulated()))
    return records


def _combine_moments(
    acc: tuple[int, np.ndarray, np.ndarray], values: np.ndarray
) -> tuple[int, np.ndarray, np.ndarray]:
    """Chan et al. pairwise update of (count, mean, M2) with a new block of float64 samples."""
    n_a, mean_a, m2_a = acc
    n_b = values.shape[0]
    if n_b == 0:
        return acc
    mean_b = values.mean(axis=0)
    m2_b = ((values - mean_b) ** 2).sum(axis=0)
    n = n_a + n_b
    delta = mean_b - mean_a
    mean = mean_a + delta * (n_b / n)
    m2 = m2_a + m2_b + delta**2 * (n_a * n_b / n)
    return n, mean, m2


class TrajectoryStore:
    """Read-only view of a trajectory store; optionally verifies every file against a manifest."""

    def __init__(
        self, url: str, group: zarr.Group, manifest: dict | None, zstore: Any = None, fast_decode: bool = True
    ) -> None:
        self.url = url
        self.manifest = manifest
        self.spec = _stored_spec(group, url)
        # Where a collected dataset's episodes come from (init_store's ``lineage``); None for a scripted policy's.
        self.lineage: dict | None = group.attrs["worldpipe"].get("lineage")
        self._layout = {a.name: a for a in array_layout(self.spec)}
        # Open the arrays the spec implies by name: no directory listing (slow on object stores, and it
        # would trip over unrelated files).
        self._arrays = {name: group[name] for name in self._layout}
        self._zstore = zstore if zstore is not None else group.store
        formats = {name: ShardFormat.from_array(arr) for name, arr in self._arrays.items()}
        self._formats = formats if fast_decode and all(f is not None for f in formats.values()) else None
        self.obs_dim = int(self._arrays["obs"].shape[2])
        self.act_dim = int(self._arrays["action"].shape[2])
        self.num_episodes = int(self._arrays["obs"].shape[0])
        self.max_steps = int(self._arrays["obs"].shape[1])
        lengths = self._read_arrays(("length",), 0, self.num_episodes)["length"]
        self.lengths = np.asarray(lengths).astype(np.int32, copy=False)
        self.has_pixels = "pixels" in self._arrays
        self._stats: dict[str, np.ndarray] | None = None

    @property
    def fast_decode(self) -> bool:
        """Whether shards are decoded directly (True) or through zarr's codec pipeline."""
        return self._formats is not None

    @classmethod
    def open(
        cls,
        url: str,
        manifest: dict | None = None,
        storage_options: dict[str, Any] | None = None,
        fast_decode: bool = True,
    ) -> TrajectoryStore:
        """Open ``url`` read-only. With ``manifest``, any file whose bytes differ raises CorruptShardError.

        ``fast_decode=False`` forces zarr's own decoding (same values, slower; for cross-checks).
        """
        store = open_zarr_store(url, read_only=True, storage_options=storage_options)
        if manifest is not None:
            expected = {f["path"]: f for f in manifest["files"]}
            store = VerifyingStore(store, expected, location=url)
        group = zarr.open_group(store, mode="r", zarr_format=3)
        return cls(url, group, manifest, zstore=store, fast_decode=fast_decode)

    def _read_arrays(self, keys: tuple[str, ...], start: int, stop: int) -> dict[str, np.ndarray]:
        if self._formats is not None and stop > start:
            return self._read_shards_direct(keys, start, stop)

        async def read_all() -> list[Any]:
            # One event-loop round trip for all arrays: zarr's per-call overhead dominates small reads.
            return await asyncio.gather(
                *(self._arrays[k].async_array.getitem(slice(start, stop)) for k in keys)
            )

        values = sync(read_all())
        return {k: np.asarray(v) for k, v in zip(keys, values, strict=True)}

    def _read_shards_direct(self, keys: tuple[str, ...], start: int, stop: int) -> dict[str, np.ndarray]:
        assert self._formats is not None
        per = self.spec.episodes_per_shard
        shards = range(start // per, (stop - 1) // per + 1)
        requests = [(k, s, self._layout[k].shard_key(s)) for k in keys for s in shards]
        prototype = default_buffer_prototype()

        async def fetch() -> list[Any]:
            return await asyncio.gather(*(self._zstore.get(key, prototype) for _, _, key in requests))

        raws = sync(fetch())
        parts: dict[str, list[np.ndarray]] = {k: [] for k in keys}
        for (k, s, key), raw in zip(requests, raws, strict=True):
            first, last = self.spec.shard_range(s)
            parts[k].append(
                self._formats[k].decode(None if raw is None else raw.to_bytes(), last - first, key)
            )
        offset = shards[0] * per
        return {
            k: (v[0] if len(v) == 1 else np.concatenate(v))[start - offset : stop - offset]
            for k, v in parts.items()
        }

    @property
    def data_keys(self) -> tuple[str, ...]:
        """Per-step arrays returned by read_episodes, besides ``length``."""
        keys = ("obs", "action", "reward", "terminated")
        return (*keys, "pixels") if self.has_pixels else keys

    def observation_dim(self, key: str) -> int:
        """Width of one step of array ``key`` as a flat observation: obs_dim for "obs", H*W*3 for "pixels"."""
        if key == "obs":
            return self.obs_dim
        if key == "pixels" and self.has_pixels:
            return 3 * self.spec.pixel_size**2
        raise KeyError(key)

    @property
    def num_shards(self) -> int:
        """Number of shards per array."""
        return self.spec.num_shards

    def read_episodes(self, start: int, stop: int) -> dict[str, np.ndarray]:
        """Episodes ``[start, stop)`` of every array, padded to max_steps; whole shards, one batched fetch."""
        if not 0 <= start <= stop <= self.num_episodes:
            raise IndexError(f"episode range [{start}, {stop}) outside [0, {self.num_episodes})")
        out = self._read_arrays(self.data_keys, start, stop)
        out["length"] = self.lengths[start:stop].copy()
        return out

    def read_shard(self, shard_index: int) -> dict[str, np.ndarray]:
        """All episodes of one shard (see read_episodes)."""
        return self.read_episodes(*self.spec.shard_range(shard_index))

    def obs_stats(self) -> dict[str, np.ndarray]:
        """Mean/std of observations and rewards over valid steps (float64, fixed shard order)."""
        if self._stats is None:
            obs_acc = (0, np.zeros(self.obs_dim), np.zeros(self.obs_dim))
            rew_acc = (0, np.zeros(()), np.zeros(()))
            for s in range(self.num_shards):
                start, stop = self.spec.shard_range(s)
                data = self._read_arrays(("obs", "reward"), start, stop)
                obs, rew = data["obs"], data["reward"]
                valid = np.arange(self.max_steps)[None, :] < self.lengths[start:stop, None]
                obs_acc = _combine_moments(obs_acc, obs[valid].astype(np.float64))
                rew_acc = _combine_moments(rew_acc, rew[valid].astype(np.float64))
            self._stats = {
                "obs_mean": obs_acc[1],
                "obs_std": np.maximum(np.sqrt(obs_acc[2] / max(obs_acc[0], 1)), _STD_FLOOR),
                "reward_mean": np.asarray(rew_acc[1], np.float64),
                "reward_std": np.asarray(np.maximum(np.sqrt(rew_acc[2] / max(rew_acc[0], 1)), _STD_FLOOR)),
            }
        return {k: v.copy() for k, v in self._stats.items()}

    def array_info(self) -> dict[str, dict]:
        """Shape and dtype of every array."""
        return {
            name: {"shape": list(arr.shape), "dtype": str(arr.dtype)}
            for name, arr in sorted(self._arrays.items())
        }
