"""The Trainer: one run of world-model training, in named steps that read top to bottom.

    setup     seeds, data (verified store, world-size-invariant global order, this rank's slice), model,
              optimizer, schedule, the Checkpointer and the records
    resume    restore every component from the newest intact checkpoint; open (or reopen) the MLflow run
    loop      train_step → advance → log_step → maybe_checkpoint, until done or preempted
    finish    completion (or preemption) record, final MLflow status

The trainer talks to the model only through the world-model interface (:mod:`worldpipe.models.base`) and to
the state only through the Checkpointer (:mod:`worldpipe.checkpoint.checkpointer`).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import sys
import time
from dataclasses import dataclass

import torch
from omegaconf import DictConfig
from tqdm import tqdm

from worldpipe.checkpoint.checkpointer import Checkpointer, Progress, TrainingComponents
from worldpipe.config.identity import ConfigError, run_identity
from worldpipe.core import numerics
from worldpipe.data.loader import WindowLoader
from worldpipe.data.manifest import load_manifest
from worldpipe.data.sampler import GlobalWindowSampler
from worldpipe.data.store import TrajectoryStore
from worldpipe.measure.startup import mark
from worldpipe.measure.timers import PartClock
from worldpipe.models import build_model, flat_observations, observation_key
from worldpipe.models.noise import sample_noise
from worldpipe.models.restore import DIMS_KEY, model_dims_record
from worldpipe.parallel.layout import build_layout
from worldpipe.parallel.runtime import Runtime, all_reduce_sum, any_rank, gather_objects
from worldpipe.parallel.wrap import replica_digest
from worldpipe.trainer.optim import build_optimizer, build_scheduler
from worldpipe.trainer.preemption import EXIT_PREEMPTED, PreemptionFlag
from worldpipe.trainer.recording import TrainingRecords
from worldpipe.trainer.resume import check_resume_identity
from worldpipe.trainer.seeding import RngTrace, seed_rank_generators
from worldpipe.trainer.warm_start import warm_start_state

log = logging.getLogger("worldpipe.trainer.main")


def use_compile_cache(path: str | None) -> None:
    """Keep torch.compile's on-disk caches (Inductor's FX graph cache, AOTAutograd's cache) under ``path``.

    By default they live in a per-user folder of the node's /tmp, which a restart on another node (a requeued
    job) or a cleaned /tmp does not have: every such process compiles from cold (minutes). Under the results
    folder, reruns and resumes find the compiled artifacts wherever they start. The caches key every entry by the
    graph, the torch version and its settings, so a changed model never gets stale code. The config decides:
    torch fills TORCHINDUCTOR_CACHE_DIR with its default as soon as anything touches Inductor (before this runs),
    so the variable is overwritten here; set ``paths.compile_cache`` to choose another folder.
    """
    if path:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.abspath(path)


@contextlib.contextmanager
def setup_frozen():
    """Keep the objects that exist now out of the collector's passes while the block runs.

    What setup made (modules, model, optimizer, data, config: ~330k objects on the smoke run) lives for the whole
    run; frozen (``gc.freeze``), it is not walked again by the full passes that a save's allocations trigger inside
    the loop (~0.1 s each on 2 cores; `worldpipe bench loop`). Unfrozen after, so an in-process run leaves its
    caller's collector as it found it.
    """
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@dataclass(frozen=True)
class LoopSettings:
    """The config values the loop reads at every step, as plain Python values.

    A lookup in the resolved config (an OmegaConf node) is slow enough to show in a small model's step time
    (`worldpipe bench loop` measures it; docs/benchmarks.md).
    """

    seed: int
    steps: int
    log_every: int
    batch_size: int
    grad_clip: float

    @classmethod
    def from_config(cls, cfg: DictConfig) -> LoopSettings:
        """Read once from the resolved config."""
        t_cfg = cfg.trainer
        return cls(seed=int(cfg.seed), steps=int(t_cfg.steps), log_every=int(t_cfg.log_every),
                   batch_size=int(t_cfg.batch_size), grad_clip=float(t_cfg.grad_clip))


class Trainer:
    """Trains (or resumes) the run described by a resolved config on this process's rank."""

    def __init__(self, cfg: DictConfig, runtime: Runtime) -> None:
        self.cfg = cfg
        self.rt = runtime

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        """Seeds, data, model, optimizer, schedule, Checkpointer, records (every rank; no files written)."""
        cfg, rt = self.cfg, self.rt
        self.settings = LoopSettings.from_config(cfg)
        numerics.check_pinned(cfg.get("numerics"))  # a portable run's code paths hold in this process
        if cfg.trainer.deterministic and rt.device.type == "cuda":
            numerics.set_deterministic_cuda()  # before the first CUDA kernel
        torch.set_num_threads(cfg.trainer.threads_per_rank)
        torch.use_deterministic_algorithms(cfg.trainer.deterministic)
        seed_rank_generators(cfg.seed, rt.rank)
        self.preemption = PreemptionFlag()
        self.layout = build_layout(cfg.parallel, rt)  # device mesh, this rank's data slice, wrapping, loss scale
        self._setup_data()
        mark("dataset_verified")
        self._setup_model()  # identical init on every rank: same torch seed
        mark("model_built")
        self.noise_generator = torch.Generator()
        self.rng_trace = RngTrace.from_env(rt.rank)
        self.progress = Progress()
        self.identity = run_identity(cfg, self.dataset_hash, rt.world_size, cfg.parallel.strategy, None)
        self.identity["parallel_layout"] = {**self.layout.describe, "world_size": rt.world_size}
        # What the model was built for, so a checkpoint alone rebuilds it (identity: not part of the digest).
        if self.warm_start is not None:  # which bits it started from (identity: not part of the digest)
            self.identity["warm_start"] = self.warm_start[1]
        self.identity[DIMS_KEY] = model_dims_record(self.core.obs_dim, self.store.act_dim)
        # What decides the bits besides code and config (recorded beside the identity; not in the digest).
        self.identity[numerics.IDENTITY_KEY] = numerics.environment(str(rt.device))
        self.records = TrainingRecords(cfg, rt.is_main)
        components = TrainingComponents(
            model=self.model, optimizer=self.optimizer, scheduler=self.scheduler, loader=self.loader,
            progress=self.progress, identity=self.identity,
            torch_generators={"latent_noise": self.noise_generator}, stages=self.layout.pp_size > 1)
        self.checkpointer = Checkpointer(cfg.checkpoint, rt, components, listener=self.records)

    def _setup_data(self) -> None:
        d_cfg, t_cfg = self.cfg.data, self.cfg.trainer
        self.manifest = load_manifest(d_cfg.manifest)
        self.dataset_hash = self.manifest["dataset_hash"]
        store = TrajectoryStore.open(d_cfg.store, manifest=self.manifest)
        self.store, self.obs_stats = store, store.obs_stats()
        sampler = GlobalWindowSampler(store.lengths, d_cfg.window, d_cfg.stride, t_cfg.batch_size, self.cfg.seed)
        # Ranks of one tensor/context-parallel group load the same windows: the data-parallel slice.
        self.loader = WindowLoader(store, sampler, self.layout.dp_rank, self.layout.dp_size, obs_stats=self.obs_stats,
                                   cache_bytes=d_cfg.cache_mb << 20, prefetch=d_cfg.prefetch)

    def _setup_model(self) -> None:
        self.observed = observation_key(self.cfg.model)
        if self.observed not in self.store.data_keys:
            raise ConfigError(f"config key 'model._target_': {self.cfg.model._target_} observes "
                              f"{self.observed!r}, which dataset {self.store.spec.name!r} does not store "
                              f"(set {self.observed}: true in its spec)")
        obs_dim = self.store.observation_dim(self.observed)
        self.core = build_model(self.cfg.model, obs_dim, self.store.act_dim).to(self.rt.device)
        # A warm start (init_from) begins from another run's final weights; the normalisation stays this data's.
        self.warm_start = warm_start_state(self.cfg)
        if self.warm_start is not None:
            self.core.load_state_dict(self.warm_start[0])
        self.core.set_normalization(self.obs_stats["obs_mean"], self.obs_stats["obs_std"])
        self.model = self.layout.wrap(self.core)
        # The wrapped model's parameters, listed once (walking the modules at every step shows in the step time);
        # the optimizer holds the same objects, so they are never replaced.
        self.parameters = list(self.model.parameters())
        # Opt-in: the compiled loss fuses kernels, so its bits differ from eager; a compiled run is still
        # deterministic and resumes to the same bits as an uninterrupted compiled run (test_compile.py).
        self.loss_fn = self.model
        if self.cfg.trainer.get("compile", False):
            use_compile_cache(self.cfg.paths.get("compile_cache"))
            self.loss_fn = torch.compile(self.model)
        fused = bool((self.cfg.get("numerics") or {}).get("fused_optimizer", False))
        self.optimizer = build_optimizer(self.model, self.cfg.trainer, fused, **self.layout.optimizer_kwargs)
        self.scheduler = build_scheduler(self.optimizer, self.cfg.trainer)

    # ----------------------------------------------------------------- resume
    def resume(self) -> int:
        """Restore from the newest intact checkpoint (if any) and open the MLflow run; returns the start step."""
        resumed = self.checkpointer.resume(
            lambda identity, step: check_resume_identity(identity, self.cfg, self.dataset_hash, step))
        mark("resumed")
        run_id, start = None, 0
        for group in self.optimizer.param_groups:  # a checkpoint from another layout carries its options
            group.update(self.layout.optimizer_kwargs)
        if resumed is not None:
            run_id, start = resumed.identity.get("mlflow_run_id"), resumed.step
            if self.rt.is_main:
                log.info("resumed from %s step %d (written by %d ranks, now %d)", self.cfg.checkpoint.dir, start,
                         resumed.identity["world_size"], self.rt.world_size)
            self._note_numerics_change(resumed.identity, start)
            if start > self.cfg.trainer.steps and self.rt.is_main:
                log.warning("worldpipe: this run is already at step %d, past trainer.steps=%d: nothing to train, "
                            "and its %d steps stay (a shorter run is a new run: pass another run_dir)", start,
                            self.cfg.trainer.steps, start)
        self.identity["mlflow_run_id"] = run_id
        run_id = gather_objects(self.rt, self.records.open_run(self.identity, run_id, start))[0]
        self.identity["mlflow_run_id"] = run_id
        self.records.log_start(self.identity, self.manifest, start)
        mark("mlflow_run_started")
        return start

    def _note_numerics_change(self, saved: dict, step: int) -> None:
        """A resume onto another numerics environment is never silent: one warning line, and the identity (so
        every later checkpoint, the MLflow run's tags and `worldpipe runs list`) keeps each such change."""
        changes = list(saved.get(numerics.CHANGES_KEY) or [])
        fields = numerics.differences(saved.get(numerics.IDENTITY_KEY), self.identity[numerics.IDENTITY_KEY])
        if fields:
            changes.append({"step": step, "fields": fields})
            if self.rt.is_main:
                log.warning("worldpipe: resuming step %d on a different numerics environment (the steps from "
                            "here are not bitwise those of an uninterrupted run): %s", step, "; ".join(fields))
        if changes:
            self.identity[numerics.CHANGES_KEY] = changes

    # ------------------------------------------------------------------- step
    def train_step(self, batch: dict) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Forward (loss sums over this rank's valid steps), backward, clip, optimizer and schedule step."""
        device = self.rt.device
        obs, action = self._observations(batch), batch["action"].to(device)  # [b,T,O], [b,T,A]
        reward, mask = batch["reward"].to(device), batch["mask"].to(device)  # [b,T]
        noise = sample_noise(self.settings.seed, batch["sample_index"], self.core.noise_shape(obs.shape[1]),
                             self.noise_generator)
        # Context parallel: this rank's chunk in time (noise is drawn for the whole window first).
        part = self.layout.shard_batch({"obs": obs, "action": action, "reward": reward, "mask": mask,
                                        "noise": None if noise is None else noise.to(device)})
        if self.rng_trace is not None:
            self.rng_trace.record()
        self.optimizer.zero_grad(set_to_none=True)
        # Gradient of the GLOBAL mean over valid steps, whatever the layout's wrapper averages over (a pipeline
        # runs its schedule over microbatches here).
        sums = self.layout.forward_backward(self.loss_fn, part, batch["global_valid"], self.core.loss_terms)
        grad_norm = self.layout.clip_grad_norm(self.parameters, self.settings.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        return sums, grad_norm

    def _observations(self, batch: dict) -> torch.Tensor:
        """The normalized observations the model reads: the loader's state vectors, or flat frames [b,T,H*W*3]."""
        if self.observed == "obs":
            return batch["obs"].to(self.rt.device)  # normalized by the loader
        raw = flat_observations(batch, self.observed).to(self.rt.device)
        return (raw - self.core.obs_mean) / self.core.obs_std

    def advance(self, batch: dict) -> None:
        """Count the step and the global samples and valid tokens it consumed."""
        self.progress.step += 1
        self.progress.samples_seen += batch["global_batch_size"]
        self.progress.tokens_seen += batch["global_valid"]
        self.progress.epoch = self.loader.state_dict()["epoch"]

    def log_step(self, sums: dict, grad_norm: torch.Tensor, batch: dict, timing: dict[str, float]) -> float:
        """Global per-valid-step losses and throughput (collective); returns the loss for the progress bar."""
        loop = self.settings
        terms = self.core.loss_terms
        totals = all_reduce_sum(self.rt, torch.stack([sums[k].detach() for k in terms]).cpu())
        totals = totals * self.layout.metric_weight  # tensor-parallel ranks hold copies of the same sums
        now = time.perf_counter()
        metrics = {f"loss/{k}": float(v) / batch["global_valid"] for k, v in zip(terms, totals, strict=True)}
        metrics.update({
            "grad_norm": float(grad_norm), "lr": self.scheduler.get_last_lr()[0],
            "samples_per_s": loop.log_every * loop.batch_size / (now - timing["window_start"]),
            "step_time_s": now - timing["step_start"], "data_wait_s": timing["data_wait"],
        })
        steps_per_s = loop.log_every / (now - timing["window_start"])
        timing["window_start"] = time.perf_counter()
        self.records.add_metrics(self.progress.step, metrics, int(time.time() * 1000))
        self.records.progress(self.progress.step, loop.steps, metrics["loss/total"], steps_per_s)
        return metrics["loss/total"]

    def maybe_checkpoint(self, preempted: bool) -> str | None:
        """Save when the cadence says so, or at the final step; returns the digest on rank 0."""
        final = self.progress.step == self.settings.steps or preempted
        if self.checkpointer.should_save(self.progress.step, final):
            return self.checkpointer.save(self.progress.step, final)
        self.checkpointer.poll()  # an async save's publication done: its records go now
        return None

    # ------------------------------------------------------------------- loop
    def loop(self) -> tuple[str | None, bool]:
        """Step until the configured number of steps or a preemption; returns (final digest, preempted)."""
        loop = self.settings
        bar = tqdm(total=loop.steps, initial=self.progress.step, desc="train", dynamic_ncols=True,
                   disable=not (self.rt.is_main and self.cfg.trainer.progress_bar), file=sys.stderr,
                   mininterval=0.5 if sys.stderr.isatty() else 15.0)  # a log file gets a line every 15 s
        digest, preempted = None, False
        timing = {"window_start": time.perf_counter()}
        clock = PartClock()  # where the wall time goes (worldpipe bench loop reads it from the trace)
        with setup_frozen():
            while self.progress.step < loop.steps:
                timing["step_start"] = time.perf_counter()
                batch = self.loader.next_batch()
                timing["data_wait"] = time.perf_counter() - timing["step_start"]
                clock.lap("data")
                sums, grad_norm = self.train_step(batch)
                clock.lap("compute")
                if timing.setdefault("first", True):
                    mark("first_step_done")
                    timing["first"] = False
                self.advance(batch)
                if self.progress.step % loop.log_every == 0 or self.progress.step == loop.steps:
                    bar.set_postfix(loss=f"{self.log_step(sums, grad_norm, batch, timing):.3f}", refresh=False)
                bar.update(1)
                clock.lap("tracking")
                preempted = any_rank(self.rt, self.preemption.raised)
                clock.lap("ranks")
                digest = self.maybe_checkpoint(preempted) or digest
                clock.lap("checkpoint")
                mark("step_end")  # no-op unless WORLDPIPE_STARTUP_TRACE is set (worldpipe bench loop reads it)
                clock.lap("other")
                if preempted:
                    break
        mark("loop_parts", **clock.summary())
        bar.close()
        self.loader.close()
        self.checkpointer.close()
        if digest is None and self.rt.is_main:  # resumed from the final checkpoint: nothing left to train
            digest = self.checkpointer.digest(self.progress.step)
        return digest, preempted

    # ----------------------------------------------------------------- finish
    def finish(self, digest: str | None, preempted: bool) -> dict:
        """Write the completion (or preemption) record; a preempted run exits with the requeue code."""
        mine = replica_digest(self.model, self.cfg.parallel.strategy) if self.layout.replicated_parameters else None
        replica_digests = gather_objects(self.rt, mine)
        record = {"final_step": self.progress.step, "target_steps": self.cfg.trainer.steps, "digest": digest,
                  "replica_digests": replica_digests, "mlflow_run_id": self.identity["mlflow_run_id"],
                  "dataset_hash": self.dataset_hash, "world_size": self.rt.world_size,
                  "checkpoint_dir": str(self.cfg.checkpoint.dir)}
        if preempted:
            self.records.preempted(record)
            if self.rt.is_main:
                log.warning("preempted by signal %s: checkpoint at step %d published", self.preemption.signal,
                            self.progress.step)
            raise SystemExit(EXIT_PREEMPTED)
        self.records.finished(record)
        return record

    def fit(self) -> dict:
        """setup → resume → loop → finish; returns the completion record."""
        try:
            self.setup()
            self.resume()
            try:
                digest, preempted = self.loop()
                return self.finish(digest, preempted)
            except Exception:
                self.records.failed()
                raise
        finally:
            # The loader's prefetch thread is a daemon: left running past a failure in setup or the loop, it can be
            # inside torch's C++ when the interpreter ends, which then aborts (SIGABRT) instead of exiting with the
            # error's status. Closing is idempotent: a loop that ended has closed it already.
            loader = getattr(self, "loader", None)
            if loader is not None:
                loader.close()
