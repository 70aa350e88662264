"""Held-out contexts to start sessions from: windows of the dataset evaluation treats as held-out.

The play page (:mod:`worldpipe.rollout.http.play`) starts a session from real observations the model never
trained on. They come from the held-out store and manifest ``worldpipe serve --heldout-store/--heldout-manifest``
names (the two ``worldpipe evaluate --store/--manifest`` takes), cut into windows by the function evaluation
cuts its segments with (:func:`worldpipe.evaluate.open_loop.heldout_segments`), so a context shown here is the
start of a segment evaluation scores.
"""

from __future__ import annotations

import threading

import numpy as np

from worldpipe.core.errors import UsageError, UserError, one_line
from worldpipe.data.manifest import load_manifest
from worldpipe.data.store import TrajectoryStore
from worldpipe.evaluate.open_loop import heldout_segments


class HeldoutContexts:
    """The held-out episodes of one sealed dataset, read once (verified against the manifest) and kept."""

    def __init__(self, dataset_hash: str, episodes: dict[str, np.ndarray]) -> None:
        self.dataset_hash = dataset_hash
        self.episodes = episodes
        self.key = "obs"  # the array windows are cut from: see observed_by
        self.obs_dim, self.act_dim = int(episodes["obs"].shape[2]), int(episodes["action"].shape[2])
        self._segments: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._lock = threading.Lock()

    def observed_by(self, key: str) -> None:
        """Cut windows from the array a served model observes: "obs", or "pixels" (flat frames, values 0..255,
        as evaluation feeds a frame model). Raises UsageError when the held-out store lacks it."""
        if key not in self.episodes:
            raise UsageError(f"--heldout-store: it stores no {key!r} array, which the served model observes "
                             "(a frame model needs a held-out dataset with pixels: true)")
        with self._lock:
            self.key, self.obs_dim = key, int(np.prod(self.episodes[key].shape[2:]))
            self._segments.clear()

    @classmethod
    def load(cls, store_url: str, manifest_path: str) -> HeldoutContexts:
        """Read the held-out dataset; anything that stops it is one UsageError naming the option and path."""
        readable = (OSError, ValueError, KeyError, UserError)
        try:
            manifest = load_manifest(manifest_path)
        except readable as err:
            raise UsageError(f"--heldout-manifest {manifest_path}: {one_line(err)}") from None
        try:
            store = TrajectoryStore.open(store_url, manifest=manifest)
            episodes = store.read_episodes(0, store.num_episodes)
        except readable as err:
            raise UsageError(f"--heldout-store {store_url}: cannot read it against its manifest "
                             f"({one_line(err)})") from None
        return cls(manifest["dataset_hash"], episodes)

    def check_dims(self, obs_dim: int, act_dim: int, what: str) -> None:
        """Raise UsageError when the held-out data cannot feed ``what`` (a model of these sizes)."""
        if (self.obs_dim, self.act_dim) != (obs_dim, act_dim):
            raise UsageError(f"--heldout-store: its episodes have obs_dim {self.obs_dim}, act_dim {self.act_dim}; "
                             f"{what} has obs_dim {obs_dim}, act_dim {act_dim}")

    def segments(self, length: int) -> tuple[np.ndarray, np.ndarray]:
        """(obs [N,length,O], action [N,length,A]): evaluation's segments of ``length`` steps; ValueError if none."""
        longest = int(self.episodes["length"].max(initial=0))
        if length > longest:  # said in the page's terms (evaluation's own message names its config keys)
            raise ValueError(f"no held-out window of {length} steps: the longest held-out episode has {longest}")
        with self._lock:
            if length not in self._segments:
                self._segments[length] = heldout_segments(self.episodes, length, self.key)
            return self._segments[length]

    def windows(self, length: int, start: int, count: int) -> dict:
        """Windows ``start .. start+count-1`` of ``length`` steps, as JSON-ready lists, and how many there are."""
        obs, action = self.segments(length)
        stop = min(start + count, obs.shape[0])
        return {"dataset_hash": self.dataset_hash, "total": int(obs.shape[0]), "length": length,
                "contexts": [{"index": i, "obs": obs[i].tolist(), "action": action[i].tolist()}
                             for i in range(start, stop)]}
