"""Start training under torchrun: preflight first, then one process per rank, owned by this launcher.

Before any process starts: the run directory's lock is taken (one run per directory, held until torchrun has
exited; an existing directory is locked first of all, so a busy one is refused at once), the config is composed
and validated (every override's type), the data store and manifest are checked to exist and belong together,
and the resume identity is checked.

On a workstation torchrun's rendezvous store listens on 127.0.0.1 only, at a free port (c10d backend; never
``--standalone``, which listens on every interface). In a SLURM batch step (the pipeline's training rule runs
there) training becomes a job step of its own, one `worldpipe train` per node meeting at a c10d rendezvous on the
allocation's first node (:mod:`worldpipe.launch.slurm`); each node's `worldpipe train` gets the endpoint and
rendezvous id as options.

The config is composed and validated once per start, here, and recorded in RUN_DIR/hydra/config.yaml; the
workers load that record (:mod:`worldpipe.launch.worker`), they do not compose it again.

torchrun and its workers die with this launcher (:mod:`worldpipe.launch.lifeline`); torchrun's stderr is relayed so
that a failure ends as one line (:mod:`worldpipe.launch.relay`). torchrun runs as :mod:`worldpipe.launch.torchrun`, whose
stores of a loopback rendezvous listen on 127.0.0.1 only.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from omegaconf import DictConfig

from worldpipe.config.compose import check_override_syntax, compose_config
from worldpipe.config.paths import CONF_DIR
from worldpipe.core import numerics
from worldpipe.core.children import die_with_parent
from worldpipe.core.errors import ERROR_LOG, debug_enabled
from worldpipe.core.last_words import ENV_VAR, LastWords
from worldpipe.launch import slurm
from worldpipe.launch.lifeline import launcher_environment
from worldpipe.launch.local_run import record_config, run_in_process, runs_in_process
from worldpipe.launch.preflight import check_data, checked_config, world_size_of
from worldpipe.launch.relay import OutputRelay
from worldpipe.launch.run_lock import RunLock
from worldpipe.launch.torchrun import RDZV_TIMEOUT_S, torchrun_argv
from worldpipe.measure.startup import mark
from worldpipe.trainer.preemption import EXIT_PREEMPTED, PREEMPTED_RECORD

__all__ = ["launch_training", "prepared_config", "start_training", "torchrun_command"]


def torchrun_command(cfg: DictConfig, recorded: Path, rdzv_endpoint: str | None = None,
                     rdzv_id: str | None = None) -> list[str]:
    """The torchrun command line for this config: c10d rendezvous, on 127.0.0.1 unless an endpoint is given.

    Every worker loads ``recorded`` (:func:`worldpipe.launch.local_run.record_config` of ``cfg``): the config
    is composed and validated once, by this launcher.
    """
    worker = ["-m", "worldpipe.launch.worker", f"--config={Path(recorded).resolve()}"]
    return torchrun_argv(int(cfg.parallel.nproc_per_node), worker, int(cfg.parallel.nnodes), rdzv_endpoint, rdzv_id,
                         int(cfg.parallel.get("rdzv_timeout_s") or RDZV_TIMEOUT_S))


def _holds_run_lock() -> bool:
    # One launcher per node under SLURM: the first task holds the lock for the whole job.
    return int(os.environ.get("SLURM_PROCID", "0")) == 0


def _early_run_dir(overrides: list[str], config_dir: Path) -> Path | None:
    """The run directory, known without composing the config when an override names it; else from a plain
    composition (no validation, no torch); None when even that fails (the full check then names the problem)."""
    check_override_syntax(overrides)
    given = [o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0] == "run_dir"]
    if given and given[-1] and not any(c in given[-1] for c in "$'\"\\ "):
        return Path(given[-1])
    try:
        return Path(compose_config(overrides, config_dir).run_dir)
    except Exception:  # noqa: BLE001 - reported by name by the full check that follows
        return None


def _lock_before_composing(overrides: list[str], config_dir: Path) -> RunLock | None:
    """Take the lock of an existing run directory before the config is validated: a busy directory is refused at
    once (validation imports torch: seconds). A directory that does not exist yet is locked after validation, so
    that a refused config leaves nothing behind."""
    run_dir = _early_run_dir(overrides, config_dir)
    return RunLock(run_dir).acquire() if run_dir is not None and run_dir.is_dir() else None


def launch_training(overrides: list[str], rdzv_endpoint: str | None = None, config_dir: Path = CONF_DIR,
                    rdzv_id: str | None = None, cfg: DictConfig | None = None) -> int:
    """Preflight, take the run lock, run torchrun (or train in this process), forward preemption signals.

    ``cfg``, when given, is the config :func:`worldpipe.launch.preflight.checked_config` returned for
    ``overrides`` (not composed or validated again). Returns torchrun's exit status (a failed worker's own status
    when torchrun reports it), or EXIT_PREEMPTED when the run stopped on a signal after checkpointing. Raises
    (ConfigError, DataMismatch, RunLocked, ResumeRefused, SlurmRefused, ...) before any process starts.
    """
    mark("launcher_start")
    lock = _lock_before_composing(overrides, config_dir) if _holds_run_lock() and cfg is None else None
    try:
        cfg = cfg if cfg is not None else checked_config(overrides, config_dir)
        # The numerics config's code paths, for this process and every one it starts (before any computes).
        pinned_now = numerics.pin(cfg.get("numerics"))
        slurm.check_nodes(slurm.placement(os.environ), int(cfg.parallel.nnodes), None, os.environ, rdzv_endpoint)
        check_data(cfg)
        run_dir = Path(cfg.run_dir)
        if _holds_run_lock() and (lock is None or lock.path.parent.resolve() != run_dir.resolve()):
            if lock is not None:
                lock.release()
            lock = RunLock(run_dir).acquire()  # makes the run directory, durably
        # Imported only now: it brings torch (seconds), which the refusals above do not need.
        from worldpipe.trainer.resume import preflight_resume

        preflight_resume(cfg)
        # A record of an earlier preemption must not turn this attempt's failure into "preempted, retry me".
        (run_dir / PREEMPTED_RECORD).unlink(missing_ok=True)
        recorded = record_config(cfg, overrides)  # under the lock: no other launcher's workers read it
        mark("config_composed")
        world_size = int(cfg.parallel.nproc_per_node) * int(cfg.parallel.nnodes)
        # One process: no torchrun (worldpipe.launch.local_run), unless variables were pinned only now in a process
        # that has loaded torch: it may have computed already, so a fresh one trains.
        if runs_in_process(world_size, rdzv_endpoint) and not (pinned_now and "torch" in sys.modules):
            return run_in_process(cfg)
        cmd = torchrun_command(cfg, recorded, rdzv_endpoint, rdzv_id)
        return _run_torchrun(cmd, run_dir, int(cfg.parallel.nproc_per_node))
    finally:
        if lock is not None:
            lock.release()


def prepared_config(overrides: list[str]) -> DictConfig:
    """The config :func:`start_training` takes for ``overrides``: composed and checked once, here.

    In a SLURM batch step it is only composed (for the node count): every node's launcher checks its own.
    """
    if slurm.placement(os.environ) == slurm.BATCH_STEP:
        cfg = compose_config(overrides)
        world_size_of(cfg)  # parallel.nnodes is a positive integer
        return cfg
    return checked_config(overrides)


def start_training(overrides: list[str], rdzv_endpoint: str | None = None, rdzv_id: str | None = None,
                   cfg: DictConfig | None = None) -> int:
    """`worldpipe train`: train here, or, from a SLURM batch step, in a job step of its own on the job's nodes.

    ``cfg`` is :func:`prepared_config` of ``overrides`` when the caller has it already. Returns the exit status.
    """
    if slurm.placement(os.environ) != slurm.BATCH_STEP:
        return launch_training(overrides, rdzv_endpoint, rdzv_id=rdzv_id, cfg=cfg)
    cfg = cfg if cfg is not None else prepared_config(overrides)
    numerics.pin(cfg.get("numerics"))  # srun passes the environment on to every node's launcher
    return _run_job_step(overrides, int(cfg.parallel.nnodes))


def _run_job_step(overrides: list[str], nnodes: int) -> int:
    job_id = os.environ[slurm.JOB_ID_ENV]
    alloc = slurm.job_allocation(job_id)
    slurm.check_nodes(slurm.BATCH_STEP, nnodes, alloc, os.environ)
    rendezvous: list[str] = []
    endpoint = None
    if nnodes > 1:
        endpoint, rdzv_id = slurm.rendezvous(job_id, *slurm.first_node(alloc), os.environ)
        rendezvous = ["--rdzv-endpoint", endpoint, "--rdzv-id", rdzv_id]
    # The same interpreter on every node (the environment, WORLDPIPE_CONF_DIR included, travels with srun).
    command = [sys.executable, "-m", "worldpipe.cli", "train", *rendezvous, *overrides]
    print(slurm.describe(nnodes, alloc, endpoint), file=sys.stderr, flush=True)
    proc = subprocess.Popen(slurm.step_argv(nnodes, alloc, command))
    # SIGTERM (job cancelled or preempted) reaches this batch step too: pass it on and wait for the step to
    # checkpoint and exit, so that its exit status (75) is what this process returns and records.
    previous = signal.signal(signal.SIGTERM, lambda signum, _frame: proc.send_signal(signum))
    try:
        return proc.wait()
    finally:
        signal.signal(signal.SIGTERM, previous)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _run_torchrun(cmd: list[str], run_dir: Path, nproc: int) -> int:
    last_words = LastWords(nproc)  # each local rank's error line, even when its stderr fails
    try:
        return _run_and_relay(cmd, run_dir, last_words)
    finally:
        last_words.remove()


def _run_and_relay(cmd: list[str], run_dir: Path, last_words: LastWords) -> int:
    # torchrun does not handle SIGUSR1 and would die of it; SLURM sends the warning signal to every process of
    # the job step, torchrun included. An ignored disposition survives exec, so torchrun starts with SIGUSR1
    # ignored; the workers install their own handler (PreemptionFlag).
    previous = {signal.SIGUSR1: signal.signal(signal.SIGUSR1, signal.SIG_IGN)}
    try:
        # A fresh interpreter, not a fork of this one: this process has torch (and numpy's BLAS threads) loaded,
        # and a fork copies none of its other threads, only the locks they may hold.
        env = {**launcher_environment(), ENV_VAR: str(last_words.dir)}
        proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, env=env,
                                preexec_fn=die_with_parent)  # noqa: PLW1509 - it only calls prctl (resolved before)
        mark("torchrun_spawned", torchrun_pid=proc.pid)
    except BaseException:
        signal.signal(signal.SIGUSR1, previous[signal.SIGUSR1])
        raise
    received: list[int] = []

    def forward(signum, _frame):
        # torchrun turns SIGTERM into SIGTERM for every worker; the workers finish their step and checkpoint.
        received.append(signum)
        proc.send_signal(signal.SIGTERM if signum == signal.SIGUSR1 else signum)

    for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
        previous.setdefault(sig, signal.getsignal(sig))
        signal.signal(sig, forward)
    relay = OutputRelay(sys.stderr, run_dir / ERROR_LOG, debug=debug_enabled())
    try:
        relay.pump(proc.stderr.fileno())
        proc.stderr.close()
        code = proc.wait()
    finally:
        if proc.poll() is None:  # the launcher is failing: take torchrun (and so every worker) with it
            proc.kill()
            proc.wait()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return _exit_status(code, relay, received, run_dir, last_words.read() if code != 0 else [])


def _exit_status(code: int, relay: OutputRelay, received: list[int], run_dir: Path, last_words: list[str]) -> int:
    if code != 0 and (run_dir / PREEMPTED_RECORD).exists():
        return EXIT_PREEMPTED
    if code != 0 and any(sig in (signal.SIGTERM, signal.SIGUSR1) for sig in received):
        # Stopped on a preemption signal. On another node than rank 0's, torchrun may end before rank 0 has
        # written PREEMPTED; the run resumes from its newest intact checkpoint either way.
        return EXIT_PREEMPTED
    if code != 0:
        relay.write_log()
    line = relay.summary(code, last_words)
    if line is not None:
        print(("" if relay.at_line_start else "\n") + line, file=sys.stderr, flush=True)
    if code != 0 and relay.child_exit is not None and relay.child_exit > 0:
        return relay.child_exit
    return code
