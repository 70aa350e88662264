"""Start training under torchrun: preflight first, then one process per rank, owned by this launcher.

Before any process starts, once per start (:class:`Start`): the config is composed (:func:`compose_start`: cheap,
no torch), the run directory's lock is taken (one run per directory, held until torchrun has exited; an existing
directory is locked before validation, so a busy one is refused at once), the config is validated (every
override's type, the config's own rules), the data store and manifest are checked to exist and belong together,
and the resume identity is checked. The command that composed it (`worldpipe train`, a rerun) hands the one
config on to addressing, launching and its closing line.

On a workstation torchrun's rendezvous store listens on 127.0.0.1 only, at a free port (c10d backend; never
``--standalone``, which listens on every interface). In a SLURM batch step (the pipeline's training rule runs
there) training becomes a job step of its own, one `worldpipe train` per node meeting at a c10d rendezvous on the
allocation's first node (:mod:`worldpipe.launch.slurm`); each node's `worldpipe train` gets the endpoint and
rendezvous id as options.

The config is recorded in RUN_DIR/hydra/config.yaml; the workers load that record (:mod:`worldpipe.launch.worker`), they do not compose it again.

torchrun and its workers die with this launcher (:mod:`worldpipe.launch.lifeline`); torchrun's stderr is relayed so
that a failure ends as one line (:mod:`worldpipe.launch.relay`). torchrun runs as :mod:`worldpipe.launch.torchrun`, whose
stores of a loopback rendezvous listen on 127.0.0.1 only.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from worldpipe.config.compose import check_override_syntax, compose_config, value_override
from worldpipe.config.paths import CONF_DIR
from worldpipe.core import numerics
from worldpipe.core.children import die_with_parent
from worldpipe.core.errors import ERROR_LOG, debug_enabled
from worldpipe.core.last_words import ENV_VAR, LastWords
from worldpipe.launch import slurm
from worldpipe.launch.lifeline import launcher_environment
from worldpipe.launch.local_run import record_config, run_in_process, runs_in_process
from worldpipe.launch.preflight import check_data, validate, world_size_of
from worldpipe.launch.relay import OutputRelay
from worldpipe.launch.run_lock import RunLock
from worldpipe.launch.torchrun import RDZV_TIMEOUT_S, torchrun_argv
from worldpipe.measure.startup import mark
from worldpipe.trainer.preemption import EXIT_PREEMPTED, PREEMPTED_RECORD

__all__ = ["Start", "compose_config", "compose_start", "launch_training", "start_training", "torchrun_command"]


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


@dataclass
class Start:
    """One start of training: its config, composed once (:func:`compose_start`) and validated once
    (:meth:`validate`), the overrides it was composed with, and the run directory's lock while it is held."""

    cfg: DictConfig
    overrides: list[str]
    config_dir: Path = CONF_DIR
    validated: bool = False
    lock: RunLock | None = None

    def set(self, key: str, value: str) -> None:
        """Set ``key`` as the override ``key=value`` would have, and keep that override with the others (the run's
        record, and the launchers of a SLURM job step, compose from them)."""
        OmegaConf.update(self.cfg, key, value, merge=False)
        self.overrides.append(value_override(key, value))

    def validate(self) -> None:
        """Check every override's type and the config's own rules, once; raises ConfigError naming the key.

        In a SLURM batch step only the node count is checked: every node's launcher validates its own.
        """
        if self.validated:
            return
        if slurm.placement(os.environ) == slurm.BATCH_STEP:
            world_size_of(self.cfg)  # parallel.nnodes is a positive integer
        else:
            validate(self.cfg, self.overrides, self.config_dir)
        self.validated = True

    def hold_lock(self, existing_only: bool = False) -> None:
        """Hold the lock of ``cfg.run_dir`` (this node's first task only), making the directory durably.

        ``existing_only``: only when the directory exists already. A busy directory is then refused before the
        config is validated (which imports torch: seconds), and a refused config leaves no new directory behind.
        """
        run_dir = Path(self.cfg.run_dir)
        if not _holds_run_lock() or (existing_only and not run_dir.is_dir()):
            return
        if self.lock is not None and self.lock.path.parent.resolve() == run_dir.resolve():
            return
        self.release()
        self.lock = RunLock(run_dir).acquire()

    def release(self) -> None:
        """Drop the run lock, if held."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None


def compose_start(overrides: list[str], config_dir: Path = CONF_DIR) -> Start:
    """The start of ``overrides``: their syntax checked, the config composed (no validation, no torch)."""
    mark("launcher_start")
    check_override_syntax(overrides)
    return Start(compose_config(overrides, config_dir), list(overrides), Path(config_dir))


def launch_training(start: Start, rdzv_endpoint: str | None = None, rdzv_id: str | None = None) -> int:
    """Validate (unless done), take the run lock, run torchrun (or train in this process), forward preemption
    signals; the lock is released on return.

    Returns torchrun's exit status (a failed worker's own status when torchrun reports it), or EXIT_PREEMPTED when
    the run stopped on a signal after checkpointing. Raises (ConfigError, DataMismatch, RunLocked, ResumeRefused,
    SlurmRefused, ...) before any process starts.
    """
    try:
        start.hold_lock(existing_only=True)
        start.validate()
        cfg = start.cfg
        # The numerics config's code paths, for this process and every one it starts (before any computes).
        pinned_now = numerics.pin(cfg.get("numerics"))
        slurm.check_nodes(slurm.placement(os.environ), int(cfg.parallel.nnodes), None, os.environ, rdzv_endpoint)
        check_data(cfg)
        run_dir = Path(cfg.run_dir)
        start.hold_lock()
        # Imported only now: it brings torch (seconds), which the refusals above do not need.
        from worldpipe.trainer.resume import preflight_resume

        preflight_resume(cfg)
        # A record of an earlier preemption must not turn this attempt's failure into "preempted, retry me".
        (run_dir / PREEMPTED_RECORD).unlink(missing_ok=True)
        recorded = record_config(cfg, start.overrides)  # under the lock: no other launcher's workers read it
        mark("preflight_done")
        world_size = int(cfg.parallel.nproc_per_node) * int(cfg.parallel.nnodes)
        # One process: no torchrun (worldpipe.launch.local_run), unless variables were pinned only now in a process
        # that has loaded torch: it may have computed already, so a fresh one trains.
        if runs_in_process(world_size, rdzv_endpoint) and not (pinned_now and "torch" in sys.modules):
            return run_in_process(cfg)
        cmd = torchrun_command(cfg, recorded, rdzv_endpoint, rdzv_id)
        return _run_torchrun(cmd, run_dir, int(cfg.parallel.nproc_per_node))
    finally:
        start.release()


def start_training(start: Start, rdzv_endpoint: str | None = None, rdzv_id: str | None = None) -> int:
    """`worldpipe train`: train here, or, from a SLURM batch step, in a job step of its own on the job's nodes.

    Returns the exit status.
    """
    if slurm.placement(os.environ) != slurm.BATCH_STEP:
        return launch_training(start, rdzv_endpoint, rdzv_id)
    start.validate()
    numerics.pin(start.cfg.get("numerics"))  # srun passes the environment on to every node's launcher
    return _run_job_step(start.overrides, int(start.cfg.parallel.nnodes))


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
