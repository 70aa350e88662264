"""Train a world model: `train(cfg)` is a plain function, `main()` the thin Hydra entry point.

Launched under torchrun (one process per rank) by `worldpipe train` or the Snakemake rule `train_model`.
The loop, top to bottom: validate → join the process group → open data → build model/optimizer → resume from
the newest intact checkpoint → step until done or preempted → publish the final checkpoint → record.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import random
import sys
import time
from pathlib import Path

import hydra
import numpy as np
import torch
from omegaconf import DictConfig
from tqdm import tqdm

from worldpipe import identity as ident
from worldpipe.atomic import write_text_atomic
from worldpipe.checkpoint import CheckpointManager, capture_rng, checkpoint_digest, restore_rng, state_digest
from worldpipe.config import (
    ConfigError,
    config_hash,
    flatten,
    to_container,
    validate_config,
)
from worldpipe.data.loader import WindowLoader
from worldpipe.data.manifest import load_manifest
from worldpipe.data.sampler import GlobalWindowSampler
from worldpipe.data.store import TrajectoryStore
from worldpipe.models import build_model
from worldpipe.models.noise import sample_noise
from worldpipe.parallel.runtime import (
    Runtime,
    all_reduce_sum,
    any_rank,
    broadcast_object,
    gather_objects,
    init_runtime,
    shutdown_runtime,
    world_size_from_env,
)
from worldpipe.parallel.wrap import (
    full_model_state,
    full_optimizer_state,
    load_full_state,
    unwrap,
    wrap_model,
)
from worldpipe.preemption import EXIT_PREEMPTED, PREEMPTED_RECORD, PreemptionFlag
from worldpipe.resume import ResumeRefused, check_resume_identity
from worldpipe.tracking.datasets import TRAINING, DatasetRecord
from worldpipe.tracking.recorder import RunRecorder
from worldpipe.tracking.records import checkpoint_artifacts, checkpoint_tags, run_tags, start_artifacts

log = logging.getLogger("worldpipe.train")

CONF_DIR = ident.PROJECT_ROOT / "conf"
COMPLETION_RECORD = "train_done.json"


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warm-up, then cosine decay to `min_ratio` of the base learning rate."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def seed_rank_generators(seed: int, rank: int) -> None:
    """Seed the global generators: identical torch init on every rank, independent per-rank python/numpy."""
    torch.manual_seed(seed)
    random.seed(seed * 1000 + rank)
    np.random.seed((seed * 1000 + rank) % 2**32)


def build_identity(cfg: DictConfig, dataset_hash: str, runtime: Runtime, run_id: str | None) -> dict:
    """Everything that says which run a checkpoint belongs to."""
    return {
        "config": to_container(cfg),
        "config_hash": config_hash(cfg),
        "dataset_hash": dataset_hash,
        "code_version": ident.code_version(),
        "versions": ident.package_versions(),
        "lock_hash": ident.lock_hash(),
        "world_size": runtime.world_size,
        "parallel_layout": {"strategy": cfg.parallel.strategy, "world_size": runtime.world_size},
        "mlflow_run_id": run_id,
    }


def train(cfg: DictConfig) -> dict:
    """Train (or resume) the run described by `cfg`; returns the completion record."""
    validate_config(cfg, world_size_from_env())
    runtime = init_runtime(cfg.parallel.backend)
    try:
        return _train(cfg, runtime)
    finally:
        shutdown_runtime()


def _train(cfg: DictConfig, rt: Runtime) -> dict:
    t_cfg, d_cfg = cfg.trainer, cfg.data
    run_dir = Path(cfg.run_dir)
    torch.set_num_threads(t_cfg.threads_per_rank)
    torch.use_deterministic_algorithms(t_cfg.deterministic)
    seed_rank_generators(cfg.seed, rt.rank)
    preemption = PreemptionFlag()

    # ---- data: verified store, world-size-invariant global order, this rank's slice ----
    manifest = load_manifest(d_cfg.manifest)
    dataset_hash = manifest["dataset_hash"]
    store = TrajectoryStore.open(d_cfg.store, manifest=manifest)
    stats = store.obs_stats()
    sampler = GlobalWindowSampler(store.lengths, d_cfg.window, d_cfg.stride, t_cfg.batch_size, cfg.seed)
    loader = WindowLoader(store, sampler, rt.rank, rt.world_size, obs_stats=stats,
                          cache_bytes=d_cfg.cache_mb << 20, prefetch=d_cfg.prefetch)

    # ---- model, optimizer, schedule (identical init on every rank: same torch seed) ----
    core = build_model(cfg.model, store.obs_dim, store.act_dim).to(rt.device)
    core.set_normalization(stats["obs_mean"], stats["obs_std"])
    loss_terms = core.loss_terms
    model = wrap_model(core, cfg.parallel.strategy, rt)
    optimizer = torch.optim.AdamW(model.parameters(), lr=t_cfg.lr, weight_decay=t_cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, t_cfg.warmup_steps, t_cfg.steps, t_cfg.min_lr_ratio)
    )
    noise_gen = torch.Generator()
    torch_generators = {"latent_noise": noise_gen}

    # ---- resume from the newest intact checkpoint ----
    ckpt = CheckpointManager(cfg.checkpoint.dir, keep_last=cfg.checkpoint.keep_last,
                             keep_every=cfg.checkpoint.keep_every, async_save=cfg.checkpoint.async_save,
                             verify=cfg.checkpoint.verify)
    progress = {"step": 0, "epoch": 0, "samples_seen": 0, "tokens_seen": 0}
    run_id = None
    # Rank 0 chooses (and reports skipped corrupt steps); every rank then loads the same step.
    start_step = broadcast_object(rt, ckpt.latest_intact() if rt.is_main else None)
    if start_step is not None:
        state = ckpt.load(start_step)
        check_resume_identity(state["identity"], cfg, dataset_hash, start_step)
        load_full_state(model, optimizer, state["model"], state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        loader.load_state_dict(state["sampler"])
        # On another world size ranks map to different data; their streams start fresh (latent noise is
        # keyed by sample index, not by rank, so the training math does not depend on them).
        if len(state["rng"]) == rt.world_size:
            restore_rng(state["rng"][rt.rank], {}, torch_generators)
        progress = dict(state["progress"])
        run_id = state["identity"].get("mlflow_run_id")
        if rt.is_main:
            log.info("resumed from %s step %d (written by %d ranks, now %d)", cfg.checkpoint.dir, start_step,
                     state["identity"]["world_size"], rt.world_size)
        del state

    # ---- records (rank 0 only) ----
    recorder = RunRecorder(cfg.tracking.enabled and rt.is_main, cfg.tracking.uri, cfg.tracking.experiment,
                           run_dir=run_dir, system_metrics_s=cfg.tracking.get("system_metrics_interval_s", 0))
    identity = build_identity(cfg, dataset_hash, rt, run_id)
    ckpt_location = str(cfg.checkpoint.dir) if "://" in str(cfg.checkpoint.dir) else str(Path(cfg.checkpoint.dir).resolve())
    run_id = recorder.start(run_id, cfg.tracking.run_name, tags=run_tags(identity, start_step or 0),
                            resume_step=start_step or 0, checkpoint_dir=ckpt_location)
    run_id = gather_objects(rt, run_id)[0]
    identity["mlflow_run_id"] = run_id
    if rt.is_main:
        recorder.log_params(flatten(identity["config"]))
        recorder.log_files(start_artifacts(identity, manifest, run_dir, start_step or 0))
        recorder.log_datasets([DatasetRecord.from_manifest(manifest, str(d_cfg.store), TRAINING)])

    uncommitted: list[tuple] = []  # checkpoint records whose async publication may still be in flight

    def save(step: int, final: bool) -> str | None:
        """Gather full state to rank 0 and publish it; commit the records of checkpoints now durable.

        Returns the state digest on rank 0 (None elsewhere).
        """
        model_state = full_model_state(model)
        optim_state = full_optimizer_state(model, optimizer)
        rng = gather_objects(rt, capture_rng({}, torch_generators))
        if not rt.is_main:
            return None
        state = {
            "model": model_state, "optimizer": optim_state, "scheduler": scheduler.state_dict(),
            "scaler": None, "ema": None, "progress": dict(progress), "sampler": loader.state_dict(),
            "rng": rng, "identity": identity,
        }
        recorder.stage(step)  # journal metrics of steps <= step; they count once this checkpoint is durable
        ckpt.save(step, state)  # sync: published on return; async: snapshot taken, the previous save published
        digest = state_digest(state)  # now, before the next step changes the live tensors
        uncommitted.append((step, checkpoint_artifacts(step, state, digest, ckpt_location),
                            checkpoint_tags(step, digest)))
        if final or not cfg.checkpoint.async_save:
            ckpt.wait()
        durable = len(uncommitted) if final or not cfg.checkpoint.async_save else len(uncommitted) - 1
        for record in uncommitted[:durable]:
            recorder.commit(*record)
        del uncommitted[:durable]
        return digest

    # ---- the loop ----
    try:
        bar = tqdm(total=t_cfg.steps, initial=progress["step"], disable=not (rt.is_main and t_cfg.progress_bar),
                   desc="train", dynamic_ncols=True, file=sys.stderr,
                   mininterval=0.5 if sys.stderr.isatty() else 15.0)  # a log file gets a line every 15 s
        digest, preempted = None, False
        window_start = time.perf_counter()
        while progress["step"] < t_cfg.steps:
            step = progress["step"]
            t0 = time.perf_counter()
            batch = loader.next_batch()
            t_data = time.perf_counter() - t0
            obs, action = batch["obs"].to(rt.device), batch["action"].to(rt.device)  # [b,T,O], [b,T,A]
            reward, mask = batch["reward"].to(rt.device), batch["mask"].to(rt.device)  # [b,T]
            noise = sample_noise(cfg.seed, batch["sample_index"], core.noise_shape(obs.shape[1]), noise_gen)
            noise = noise.to(rt.device) if noise is not None else None

            sums = model(obs, action, reward, mask, noise)  # forward = per-term loss sums over valid steps
            # Gradient of the GLOBAL mean over valid steps: DDP/FSDP average over ranks, so scale by world size.
            loss = sums["total"] * (rt.world_size / batch["global_valid"])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), t_cfg.grad_clip)
            optimizer.step()
            scheduler.step()

            progress["step"] = step + 1
            progress["samples_seen"] += batch["global_batch_size"]
            progress["tokens_seen"] += batch["global_valid"]
            progress["epoch"] = loader.state_dict()["epoch"]

            if progress["step"] % t_cfg.log_every == 0 or progress["step"] == t_cfg.steps:
                totals = all_reduce_sum(rt, torch.stack([sums[k].detach() for k in loss_terms]).cpu())
                elapsed = time.perf_counter() - window_start
                window_start = time.perf_counter()
                metrics = {f"loss/{k}": float(v) / batch["global_valid"] for k, v in zip(loss_terms, totals, strict=True)}
                metrics.update({
                    "grad_norm": float(grad_norm), "lr": scheduler.get_last_lr()[0],
                    "samples_per_s": t_cfg.log_every * t_cfg.batch_size / elapsed,
                    "step_time_s": time.perf_counter() - t0, "data_wait_s": t_data,
                })
                recorder.add_metrics(progress["step"], metrics, int(time.time() * 1000))
                bar.set_postfix(loss=f"{metrics['loss/total']:.3f}", refresh=False)
            bar.update(1)

            preempted = any_rank(rt, preemption.raised)
            final = progress["step"] == t_cfg.steps or preempted
            if progress["step"] % cfg.checkpoint.every == 0 or final:
                digest = save(progress["step"], final)
            if preempted:
                break
        bar.close()
        loader.close()
        ckpt.close()
        if digest is None and rt.is_main:  # resumed from the final checkpoint: nothing left to train
            digest = checkpoint_digest(cfg.checkpoint.dir, progress["step"])

        # Replicas must agree bit for bit; recorded so a test (or a user) can check it after the fact.
        replica_digests = gather_objects(rt, _replica_digest(model, cfg.parallel.strategy))
        record = {"final_step": progress["step"], "target_steps": t_cfg.steps, "digest": digest,
                  "replica_digests": replica_digests, "mlflow_run_id": run_id, "dataset_hash": dataset_hash, "world_size": rt.world_size,
                  "checkpoint_dir": str(cfg.checkpoint.dir)}
        if preempted:
            if rt.is_main:
                write_text_atomic(run_dir / PREEMPTED_RECORD, json.dumps(record, indent=2))
                recorder.end("KILLED")
                log.warning("preempted by signal %s: checkpoint at step %d published", preemption.signal, progress["step"])
            raise SystemExit(EXIT_PREEMPTED)
        if rt.is_main:
            (run_dir / PREEMPTED_RECORD).unlink(missing_ok=True)
            write_text_atomic(run_dir / COMPLETION_RECORD, json.dumps(record, indent=2))
            recorder.end("FINISHED")
        return record
    except Exception:
        if rt.is_main:  # the MLflow run says FAILED rather than RUNNING forever; a resume reopens it
            recorder.end("FAILED")
        raise


def _replica_digest(model: torch.nn.Module, strategy: str) -> str | None:
    """SHA-256 of this rank's replica of the parameters (None when parameters are sharded)."""
    if strategy == "fsdp2":
        return None
    digest = hashlib.sha256()
    for name, tensor in sorted(unwrap(model).state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    """Hydra entry point (`python -m worldpipe.train key=value ...`, usually under torchrun)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    try:
        train(cfg)
    except (ConfigError, ResumeRefused) as err:
        log.error("%s", err)
        raise SystemExit(2) from err


if __name__ == "__main__":
    main()
