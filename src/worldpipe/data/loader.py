"""Per-rank window loader with deterministic background prefetch and exact, world-size-free resume."""

from __future__ import annotations

import queue
import threading
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from worldpipe.core.errors import UsageError
from worldpipe.data.episode_slab import make_slab
from worldpipe.data.sampler import GlobalWindowSampler
from worldpipe.data.store import TrajectoryStore

_PUT_POLL_S = 0.05


class WindowError(UsageError, ValueError):
    """Windows that cannot train anything: longer than every stored episode, or without a single valid step."""


@dataclass
class _Failure:
    error: BaseException


def _check_windows(store: TrajectoryStore, sampler: GlobalWindowSampler) -> None:
    """Refuse windows longer than the stored horizon, or a sampler none of whose windows holds a valid step."""
    if sampler.window > store.max_steps:
        raise WindowError(f"config key 'data.window': {sampler.window} steps is longer than every episode of the "
                          f"store (at most {store.max_steps} steps); use data.window <= {store.max_steps}")
    lengths = store.lengths.astype(np.int64)
    if not len(sampler.windows) or not (lengths[sampler.windows[:, 0]] > sampler.windows[:, 1]).any():
        raise WindowError(f"no window of {sampler.window} steps holds a valid step (episode lengths "
                          f"{int(lengths.min())}..{int(lengths.max())})")


class WindowLoader:
    """Turns the sampler's global batches into this rank's tensors.

    Prefetching runs a private copy of the sampler in a thread. The batches it produces depend only on
    the sampler position, never on timing; each carries the sampler state *after* it, and
    ``state_dict`` reports the state after the last batch actually returned, so unconsumed prefetched
    batches are never counted as seen. The caller's ``sampler`` is kept at that same position.
    """

    def __init__(
        self,
        store: TrajectoryStore,
        sampler: GlobalWindowSampler,
        rank: int,
        world_size: int,
        obs_stats: dict | None = None,
        cache_bytes: int = 256 << 20,
        prefetch: int = 2,
    ) -> None:
        GlobalWindowSampler.rank_slice(0, rank, world_size)  # validates rank / world_size
        if len(sampler.windows) and int(sampler.windows[:, 0].max()) >= store.num_episodes:
            raise ValueError("sampler windows refer to episodes beyond the store")
        if prefetch < 0:
            raise ValueError(f"prefetch must be >= 0, got {prefetch}")
        _check_windows(store, sampler)
        self.store = store
        self.sampler = sampler
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.prefetch = int(prefetch)
        self.window = sampler.window
        self._lengths = store.lengths.astype(np.int64)
        self._steps = np.arange(self.window, dtype=np.int64)
        self._stats = None
        if obs_stats is not None:
            self._stats = {
                k: np.asarray(obs_stats[k], dtype=np.float32)
                for k in ("obs_mean", "obs_std", "reward_mean", "reward_std")
            }
        horizon = store.max_steps + 1  # + one all-zero step that out-of-range window steps read
        shapes = {
            "obs": ((horizon, store.obs_dim), np.dtype(np.float32)),
            "action": ((horizon, store.act_dim), np.dtype(np.float32)),
            "reward": ((horizon,), np.dtype(np.float32)),
            "terminated": ((horizon,), np.dtype(np.float32)),
        }
        if store.has_pixels:
            size = store.spec.pixel_size
            shapes["pixels"] = ((horizon, size, size, 3), np.dtype(np.uint8))
        self._slab = make_slab(
            store.num_episodes, store.spec.episodes_per_shard, self._prepare_shard, shapes, cache_bytes
        )
        self._producer = sampler.copy()
        self._queue: queue.Queue = queue.Queue(maxsize=max(self.prefetch, 1))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._failure: _Failure | None = None
        self._start()

    # ---- production (runs in the prefetch thread, or inline when prefetch == 0) ----

    def _prepare_shard(self, shard_index: int) -> dict[str, np.ndarray]:
        """Decode, normalise and zero-pad one shard once, so batches are pure gathers."""
        raw = self.store.read_shard(shard_index)
        n, horizon = len(raw["length"]), self.store.max_steps
        valid = np.arange(horizon)[None, :] < raw["length"][:, None]
        obs, reward = raw["obs"], raw["reward"]
        if self._stats is not None:
            obs = (obs - self._stats["obs_mean"]) / self._stats["obs_std"]
            reward = (reward - self._stats["reward_mean"]) / self._stats["reward_std"]
        fields = {
            "obs": obs,
            "action": raw["action"],
            "reward": reward,
            "terminated": raw["terminated"].astype(np.float32),
        }
        if "pixels" in raw:
            fields["pixels"] = raw["pixels"]
        out = {}
        for key, value in fields.items():
            padded = np.zeros((n, horizon + 1, *value.shape[2:]), dtype=value.dtype)
            keep = valid.reshape(valid.shape + (1,) * (value.ndim - 2))
            padded[:, :horizon] = np.where(keep, value, 0)
            out[key] = padded
        return out

    def _produce(self) -> tuple[dict, dict]:
        sampler = self._producer
        batch_index, epoch = sampler.batch_index, sampler.epoch
        rows = sampler.next_global_batch()
        state_after = sampler.state_dict()

        valid_all = np.minimum(np.maximum(self._lengths[rows[:, 1]] - rows[:, 2], 0), self.window)
        if not valid_all.any():  # nothing to learn from, and the loss would be divided by zero valid steps
            raise WindowError(f"global batch {batch_index} (epoch {epoch}) holds no valid step: every window starts "
                              "at or past the end of its episode")
        mine = rows[GlobalWindowSampler.rank_slice(len(rows), self.rank, self.world_size)]
        episodes, starts = mine[:, 1], mine[:, 2]
        t_idx = starts[:, None] + self._steps[None, :]
        mask = t_idx < self._lengths[episodes][:, None]
        # Steps past the stored horizon read the extra all-zero step.
        data = self._slab.gather(episodes, np.minimum(t_idx, self.store.max_steps))
        batch = {key: torch.from_numpy(value) for key, value in data.items()}
        batch.update(
            mask=torch.from_numpy(mask.astype(np.float32)),
            sample_index=torch.from_numpy(np.ascontiguousarray(mine[:, 0])),
            global_valid=int(valid_all.sum()),
            global_batch_size=len(rows),
            batch_index=int(batch_index),
            epoch=int(epoch),
        )
        return batch, state_after

    @staticmethod
    def _run(ref: weakref.ref, stop: threading.Event, out: queue.Queue) -> None:
        # Holds the loader only weakly between batches, so an unclosed, dropped loader is still collected
        # (its finalizer sets ``stop``) instead of being kept alive by its own thread.
        while not stop.is_set():
            loader = ref()
            if loader is None:
                return
            try:
                item: tuple[dict, dict] | _Failure = loader._produce()
            except BaseException as exc:  # surfaced to the consumer, never swallowed
                item = _Failure(exc)
            del loader
            while not stop.is_set():
                try:
                    out.put(item, timeout=_PUT_POLL_S)
                    break
                except queue.Full:
                    continue
            if isinstance(item, _Failure):
                return

    def _start(self) -> None:
        if self.prefetch > 0:
            # A fresh event per thread: a stale thread can never be revived by clearing a shared one.
            self._stop = threading.Event()
            self._finalizer = weakref.finalize(self, self._stop.set)
            self._thread = threading.Thread(
                target=self._run,
                args=(weakref.ref(self), self._stop, self._queue),
                name=f"WindowLoader-r{self.rank}",
                daemon=True,
            )
            self._thread.start()

    def _drain(self) -> None:
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                return

    def _halt(self) -> None:
        if self._thread is not None:
            self._stop.set()
            # Emptying the queue wakes a producer blocked in put(); it then sees the stop flag at once.
            self._drain()
            self._thread.join()
            self._thread = None
        self._drain()

    # ---- public API ----

    def next_batch(self) -> dict:
        """This rank's slice of the next global batch.

        Tensors (``b_r`` = this rank's share, T = window): ``obs`` f32 [b_r, T, obs_dim] and ``reward``
        f32 [b_r, T] (normalised when obs_stats were given), ``action`` f32 [b_r, T, act_dim],
        ``terminated`` f32 [b_r, T], ``mask`` f32 [b_r, T] (1 where start + t < length; every other key
        is 0 where mask is 0), ``sample_index`` int64 [b_r], ``pixels`` uint8 [b_r, T, H, W, 3] if stored.
        Python ints: ``global_valid`` (valid steps in the whole global batch, for loss normalisation),
        ``global_batch_size``, ``batch_index`` (global batches drawn before this one), ``epoch``.
        """
        if self._closed:
            raise RuntimeError("WindowLoader is closed")
        if self.prefetch == 0:
            batch, state = self._produce()
        else:
            if self._failure is not None:
                raise self._failure.error
            item = self._queue.get()
            if isinstance(item, _Failure):
                # The producer has stopped; keep failing loudly instead of blocking on an empty queue.
                self._failure = item
                raise item.error
            batch, state = item
        self.sampler.load_state_dict(state)
        return batch

    def state_dict(self) -> dict:
        """Sampler state after the last returned batch (prefetched batches excluded)."""
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Resume so the next batch is the first one not returned before ``state`` was saved."""
        self._halt()
        self.sampler.load_state_dict(state)
        self._producer = self.sampler.copy()
        self._failure = None
        if not self._closed:
            self._start()

    def close(self) -> None:
        """Stop the prefetch thread. Idempotent."""
        self._closed = True
        self._halt()

    def __enter__(self) -> WindowLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
