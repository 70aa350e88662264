"""World-size-invariant, resumable sampler of fixed-length windows.

There is one global sample order per epoch, a function of (seed, epoch) only. Every rank runs an
identical sampler, draws the same global batch and keeps its contiguous slice; the state is a cursor into
the global order, so it can be saved by any rank and restored onto any number of ranks.
"""

from __future__ import annotations

import numpy as np

_STATE_KEYS = ("seed", "epoch", "cursor", "window", "stride", "global_batch", "num_windows")


def enumerate_windows(lengths: np.ndarray, window: int, stride: int) -> np.ndarray:
    """All ``(episode, start)`` pairs, start in ``range(0, max(L - window, 0) + 1, stride)``; int64 [W, 2]."""
    lengths = np.asarray(lengths, dtype=np.int64)
    counts = (np.maximum(lengths - window, 0) // stride) + 1
    episodes = np.repeat(np.arange(lengths.size, dtype=np.int64), counts)
    # Position of each window within its episode: global index minus the episode's first index.
    first = np.cumsum(counts) - counts
    starts = (np.arange(episodes.size, dtype=np.int64) - np.repeat(first, counts)) * stride
    return np.stack([episodes, starts], axis=1)


class GlobalWindowSampler:
    """Yields global batches of ``(global_sample_index, episode, start)`` rows.

    ``global_sample_index = epoch * num_windows + position in that epoch's order``: a unique id per
    drawn sample, independent of world size, from which the trainer derives per-sample randomness.
    """

    def __init__(self, lengths: np.ndarray, window: int, stride: int, global_batch: int, seed: int) -> None:
        for name, value in (("window", window), ("stride", stride), ("global_batch", global_batch)):
            if int(value) < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if int(seed) < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        lengths = np.asarray(lengths)
        if lengths.ndim != 1 or lengths.size == 0:
            raise ValueError("lengths must be a non-empty 1-D array")
        self.window = int(window)
        self.stride = int(stride)
        self.global_batch = int(global_batch)
        self.seed = int(seed)
        self.windows = enumerate_windows(lengths, self.window, self.stride)
        self.num_windows = int(self.windows.shape[0])
        self.epoch = 0
        self.cursor = 0
        self._order_epoch: int | None = None
        self._order: np.ndarray | None = None

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The permutation of window indices for ``epoch`` (cached for the current epoch)."""
        if self._order_epoch != epoch:
            rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, epoch])))
            self._order = rng.permutation(self.num_windows)
            self._order_epoch = epoch
        assert self._order is not None
        return self._order

    @property
    def batches_per_epoch(self) -> int:
        """Global batches per epoch; the last one may be smaller."""
        return -(-self.num_windows // self.global_batch)

    @property
    def batch_index(self) -> int:
        """Sequence number of the next global batch since epoch 0 (valid while global_batch is fixed)."""
        return self.epoch * self.batches_per_epoch + self.cursor // self.global_batch

    def next_global_batch(self) -> np.ndarray:
        """The next global batch, int64 [b, 3]; b < global_batch only at the epoch tail."""
        order = self.epoch_order(self.epoch)
        stop = min(self.cursor + self.global_batch, self.num_windows)
        positions = np.arange(self.cursor, stop, dtype=np.int64)
        picked = self.windows[order[self.cursor : stop]]
        rows = np.empty((positions.size, 3), dtype=np.int64)
        rows[:, 0] = self.epoch * self.num_windows + positions
        rows[:, 1:] = picked
        self.cursor = stop
        if self.cursor == self.num_windows:
            self.epoch += 1
            self.cursor = 0
        return rows

    def state_dict(self) -> dict:
        """Position in the global order; JSON-serialisable ints."""
        return {
            "seed": self.seed,
            "epoch": self.epoch,
            "cursor": self.cursor,
            "window": self.window,
            "stride": self.stride,
            "global_batch": self.global_batch,
            "num_windows": self.num_windows,
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume at ``state``; ValueError if it was saved for different windows.

        ``seed`` and ``global_batch`` are taken from the state: they are part of the run's future.
        """
        missing = [k for k in _STATE_KEYS if k not in state]
        if missing:
            raise ValueError(f"sampler state is missing {missing}")
        for key in ("window", "stride", "num_windows"):
            if int(state[key]) != getattr(self, key):
                raise ValueError(
                    f"sampler state has {key}={state[key]} but this sampler has {key}={getattr(self, key)}"
                )
        epoch, cursor, global_batch = int(state["epoch"]), int(state["cursor"]), int(state["global_batch"])
        if epoch < 0 or not 0 <= cursor < self.num_windows or global_batch < 1:
            raise ValueError(f"sampler state out of range: {state}")
        if int(state["seed"]) != self.seed:
            self._order_epoch = None  # cached permutation belongs to the old seed
        self.seed = int(state["seed"])
        self.global_batch = global_batch
        self.epoch = epoch
        self.cursor = cursor

    def copy(self) -> GlobalWindowSampler:
        """An independent sampler at the same position (shares the read-only windows table)."""
        clone = object.__new__(GlobalWindowSampler)
        clone.__dict__.update(self.__dict__)
        return clone

    @staticmethod
    def rank_slice(batch_len: int, rank: int, world_size: int) -> slice:
        """Contiguous slice of a global batch for ``rank`` (np.array_split rule: sizes differ by <= 1)."""
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"invalid rank {rank} for world size {world_size}")
        base, extra = divmod(batch_len, world_size)
        start = rank * base + min(rank, extra)
        return slice(start, start + base + (1 if rank < extra else 0))
