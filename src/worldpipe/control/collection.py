"""Collecting data with a trained model: one round of the collect-train loop of model-based RL.

A collected dataset's spec names its collector (:data:`worldpipe.data.spec.COLLECTOR_KEYS`): the finished run
whose final checkpoint acts, the planner and the exploration noise it acts with, and the parent dataset the run
trained on. Episodes ``[0, copied_episodes)`` are the parent's, copied byte for byte (the union of the earlier
rounds); every later episode ``i`` is played in the real environment from ``episode_seeds(spec.seed, i)``: the
planner decides with the model, its noise drawn from a stream named by the dataset and the episode, and Gaussian
exploration noise from the episode's own generator is added to each action. An episode is therefore a pure function
of (spec, index, checkpoint), like a simulated one, and a shard's bytes do not depend on which job wrote it.

Where the episodes come from is the dataset's *lineage* (:func:`lineage`), fixed when the store is initialised:
the collecting run's final step, checkpoint digest and MLflow run, and the hash of the dataset it trained on. It
sits in the store's attributes and, once sealed, in the manifest, so the dataset hash covers it; every collecting
job checks the checkpoint still has that digest before it acts.

Collection survives ``kill -9``: each finished shard's files are made durable and a record of it is published
atomically beside the store (``parts/collected/shard-NNNNN/record.json``); a rerun skips the shards whose record
and files are there and rewrites the others from scratch (episodes are addressed by index and seed: nothing is
duplicated or missed). A collecting job holds the run lock of every shard it writes, so a second job on the same
shards is refused naming the first.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from worldpipe.checkpoint import CheckpointManager, state_digest
from worldpipe.config import paths
from worldpipe.control.dynamics import ControlError, LearnedDynamics
from worldpipe.control.episodes import PlannerAgent, run_episode
from worldpipe.control.evaluation import action_box, build_planner
from worldpipe.control.exploration import NoveltySeeking, reference_observations
from worldpipe.control.value import VALUE_DIR, ValueShare, fitted_value
from worldpipe.core.atomic import fsync_and_close, fsync_dir, write_atomic
from worldpipe.core.hashing import canonical_json
from worldpipe.data.episodes import Episode, episode_seeds
from worldpipe.data.manifest import load_manifest, seal_dataset
from worldpipe.data.spec import DatasetSpec
from worldpipe.data.store import ShardWriter, TrajectoryStore, init_store
from worldpipe.evaluate.open_loop import load_model
from worldpipe.launch.run_lock import RunLock
from worldpipe.rollout.streams import StreamId

STREAM_PREFIX = "collect"
PROGRESS_DIR = "collected"  # beside the store, under the dataset's parts/: one directory per finished shard


class CollectionError(ControlError):
    """A collection round that cannot run as specified (a missing or changed collector, a missing parent)."""


def collector_run_dir(spec: DatasetSpec) -> str:
    """The collecting run's directory (``runs/<experiment>/<run-hash>``)."""
    return paths.run_dir(spec.collector["experiment"], spec.collector["run_hash"])


def parent_dir(spec: DatasetSpec) -> str:
    """The directory of the dataset the collecting run trained on."""
    return paths.dataset_dir(spec.collector["parent"]["name"], spec.collector["parent"]["spec_hash"])


def lineage(spec: DatasetSpec) -> dict[str, Any]:
    """Where a collected dataset's episodes come from, read from the collecting run's completion record: its final
    step, checkpoint digest, MLflow run and the hash of the data it trained on (CollectionError: not finished)."""
    run_dir = collector_run_dir(spec)
    record_path = Path(run_dir) / paths.COMPLETION_RECORD
    round_ = spec.collector["round"]
    if not record_path.is_file():
        raise CollectionError(f"round {round_} of {spec.collector['base']} collects with the model of "
                              f"{run_dir}, which has not finished training ({record_path} is missing)")
    done = json.loads(record_path.read_text())
    parent_manifest = Path(parent_dir(spec)) / paths.MANIFEST_NAME
    if not parent_manifest.is_file():
        raise CollectionError(f"round {round_} of {spec.collector['base']}: the dataset the collecting run trained "
                              f"on is not at {parent_dir(spec)} ({parent_manifest} is missing)")
    parent_hash = load_manifest(str(parent_manifest))["dataset_hash"]
    if done.get("dataset_hash") not in (None, parent_hash):
        raise CollectionError(f"{run_dir} trained on dataset {done['dataset_hash'][:16]}…, but its recorded parent "
                              f"{parent_dir(spec)} holds {parent_hash[:16]}…")
    return {
        "round": round_,
        "collector": {"run_dir": run_dir, "checkpoint_step": int(done["final_step"]),
                      "checkpoint_digest": done["digest"], "mlflow_run_id": done.get("mlflow_run_id")},
        "parent": {**spec.collector["parent"], "dataset_hash": parent_hash},
        "seed": spec.seed,
        "episodes": {"copied": spec.copied_episodes, "collected": spec.episodes - spec.copied_episodes},
    }


def _recorded_lineage(spec: DatasetSpec, recorded: dict[str, Any]) -> dict[str, Any]:
    parent_manifest = Path(parent_dir(spec)) / paths.MANIFEST_NAME
    expected = recorded["parent"]["dataset_hash"]
    if not parent_manifest.is_file() or load_manifest(str(parent_manifest))["dataset_hash"] != expected:
        raise CollectionError(f"round {spec.collector['round']} of {spec.collector['base']} copies dataset "
                              f"{expected[:16]}…, which is not at {parent_dir(spec)}")
    return recorded


def progress_root(url: str) -> Path:
    """Where finished shards are recorded: ``<dataset>/parts/collected`` beside ``<dataset>/store.zarr``."""
    return Path(url).parent / "parts" / PROGRESS_DIR


def init_collected_store(url: str, spec: DatasetSpec, recorded: dict[str, Any] | None = None) -> dict[str, Any]:
    """Initialise the store of a collected dataset with its lineage, forgetting any earlier progress.

    ``recorded``: the lineage a regeneration reproduces (from the round's recorded manifest), taken as it is once the
    parent dataset is found with its hash (the collecting checkpoint's digest is checked before any episode is
    played): the collecting run may have been rebuilt since, under another MLflow run, to the same bits.
    """
    found = lineage(spec) if recorded is None else _recorded_lineage(spec, recorded)
    # Keys in canonical order: the store's metadata bytes must not depend on whether the lineage was read from the
    # collecting run or from a record (MLflow's copy of the manifest has its keys sorted).
    found = json.loads(canonical_json(found))
    shutil.rmtree(progress_root(url), ignore_errors=True)  # shards recorded for the wiped store are gone with it
    init_store(url, spec, lineage=found)
    return found


class Collector:
    """The planner acting with the collecting run's model, plus exploration noise: episodes by index."""

    def __init__(self, spec: DatasetSpec, recorded: dict[str, Any]) -> None:
        torch.set_num_threads(1)  # one decision's bits must not depend on how many cores the machine has
        self.spec, self.collector = spec, spec.collector
        checkpoints = paths.checkpoints_dir(recorded["collector"]["run_dir"])
        step = recorded["collector"]["checkpoint_step"]
        if not Path(checkpoints).is_dir():
            raise CollectionError(f"round {self.collector['round']} of {self.collector['base']} was collected by the "
                                  f"model of {recorded['collector']['run_dir']}, which is not here ({checkpoints} "
                                  "is missing)")
        digest = state_digest(CheckpointManager(checkpoints).load(step))
        if digest != recorded["collector"]["checkpoint_digest"]:
            raise CollectionError(f"{checkpoints} step {step} has digest {digest[:16]}…, the store was initialised "
                                  f"for {recorded['collector']['checkpoint_digest'][:16]}…: reinitialise the round")
        self.model, identity = load_model(checkpoints, step)
        self.model.eval()
        self.run_seed = int(identity["config"].get("seed", 0))
        self.box = action_box(spec.env_id)
        self.parent: TrajectoryStore | None = None
        novelty = self.collector.get("novelty")
        if spec.copied_episodes or novelty:
            manifest = load_manifest(str(Path(parent_dir(spec)) / paths.MANIFEST_NAME))
            self.parent = TrajectoryStore.open(str(Path(parent_dir(spec)) / paths.STORE_NAME), manifest)
        # The data the collecting run trained on, which the novelty bonus measures imagined observations against.
        self.reference = reference_observations(self.parent, novelty["reference"]) if novelty else None
        # The terminal value the collecting planner adds past its horizon, fitted once for every episode.
        value, planner = self.collector.get("value"), build_planner(self.collector["planner"], *self.box)
        share = ValueShare(str(Path(checkpoints).parent / VALUE_DIR), digest)
        self.value = (fitted_value(self.model, identity["config"], value, planner, self.collector["context"],
                                   self.box, share) if value else None)

    def episodes(self, shard_index: int) -> Iterable[Episode]:
        """The episodes of one shard, in index order: copied from the parent, then collected."""
        start, stop = self.spec.shard_range(shard_index)
        copied = min(stop, self.spec.copied_episodes)
        if start < copied:
            arrays = self.parent.read_episodes(start, copied)
            for i, n in enumerate(arrays["length"]):
                yield Episode(arrays["obs"][i, :n], arrays["action"][i, :n], arrays["reward"][i, :n],
                              arrays["terminated"][i, :n], None)
        for index in range(max(start, copied), stop):
            yield self.collect(index)

    def collect(self, index: int) -> Episode:
        """Episode ``index`` played by the planner with the model (deterministic)."""
        reset_seed, rng = episode_seeds(self.spec.seed, index)
        stream = StreamId(self.run_seed, f"{STREAM_PREFIX}/{self.spec.name}/{self.spec.seed}/{index}")
        planner = build_planner(self.collector["planner"], *self.box)
        dynamics = LearnedDynamics(self.model, self.collector["context"], self.value, planner.discount)
        if self.reference is not None:
            dynamics = NoveltySeeking(dynamics, self.reference, self.collector["novelty"]["weight"])
        planner = PlannerAgent(planner, dynamics, stream)
        agent = ExploringAgent(planner, float(self.collector["exploration_std"]), *self.box)
        with torch.no_grad():
            result = run_episode(self.spec.env_id, self.spec.max_steps, reset_seed, rng, agent,
                                 env_options=self.spec.env_options)
        return Episode(np.stack(result.observations), np.stack(result.actions),
                       np.asarray(result.rewards, np.float32), np.asarray(result.terminated, bool), None)


class ExploringAgent:
    """An agent's action plus Gaussian noise (``std`` times the box's half-width), clipped to the box; the noise
    comes from the episode's generator, so the episode stays a function of its seed."""

    def __init__(self, agent, std: float, low: float, high: float) -> None:
        self.agent, self.std, self.low, self.high = agent, std, low, high

    def reset(self, act_dim: int, rng: np.random.Generator) -> None:
        self.agent.reset(act_dim, rng)
        self.rng = rng

    def act(self, observations, actions, step: int, timing: dict[str, float]) -> np.ndarray:
        action = np.asarray(self.agent.act(observations, actions, step, timing), np.float32)
        noise = self.rng.normal(0.0, self.std * (self.high - self.low) / 2, size=action.shape)
        return np.clip(action + noise, self.low, self.high).astype(np.float32)


def _make_durable(files: list[str]) -> None:
    for file in files:
        fsync_and_close(os.open(file, os.O_RDONLY))
    for directory in sorted({os.path.dirname(file) for file in files}):
        fsync_dir(directory)


def _shard_done(writer: ShardWriter, record_dir: Path, shard_index: int) -> dict | None:
    record = record_dir / "record.json"
    root = Path(writer.url)
    if record.is_file() and all((root / key).is_file() for key in writer.shard_files(shard_index)):
        return json.loads(record.read_text())
    return None


def write_collected_shards(url: str, spec: DatasetSpec, shard_indices: Iterable[int],
                           log=print) -> list[dict]:
    """Collect and write the episodes of ``shard_indices``, skipping the shards a killed job finished."""
    indices = list(dict.fromkeys(int(i) for i in shard_indices))
    for s in indices:
        spec.shard_range(s)
    writer = ShardWriter(url, spec)
    recorded = TrajectoryStore.open(url).lineage
    if recorded is None:
        raise CollectionError(f"{url} holds no lineage: initialise it with `worldpipe data init` for this spec")
    records, collector = [], None
    with contextlib.ExitStack() as held:
        for s in indices:  # every shard's lock first: a second job on any of them is refused before any work
            held.enter_context(RunLock(progress_root(url) / f"shard-{s:05d}", what="collection shard"))
        for s in indices:
            record_dir = progress_root(url) / f"shard-{s:05d}"
            done = _shard_done(writer, record_dir, s)
            if done is not None:
                log(f"shard {s}: collected by an earlier attempt, kept")
                records.append(done)
                continue
            collector = collector or Collector(spec, recorded)
            record = writer.write(s, collector.episodes(s))
            _make_durable([os.path.join(url, key) for key in writer.shard_files(s)])  # before the record vouches
            write_atomic(record_dir / "record.json", canonical_json(record))
            log(f"shard {s}: {record['episodes']} episodes, {record['steps']} steps")
            records.append(record)
    return records


def build_collected_dataset(url: str, spec: DatasetSpec, manifest_path: str,
                            recorded: dict[str, Any] | None = None) -> dict:
    """Collect a whole round in this process from its spec (and ``recorded`` lineage: the records a rerun has) and
    seal it; the manifest. The collecting run's checkpoint and parent dataset must be on disk: CollectionError names
    the first that is not."""
    init_collected_store(url, spec, recorded)
    write_collected_shards(url, spec, range(spec.num_shards), log=lambda _line: None)
    return seal_dataset(url, manifest_path)
