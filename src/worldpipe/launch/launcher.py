"""Start training under torchrun: preflight first, then one process per rank, owned by this launcher.

Before any process starts: the run directory's lock is taken (one run per directory, held until torchrun has
exited; an existing directory is locked first of all, so a busy one is refused at once), the config is composed
and validated (every override's type), the data store and manifest are checked to exist and belong together,
and the resume identity is checked.

On a workstation torchrun's rendezvous store listens on 127.0.0.1 only, at a free port (c10d backend; never
``--standalone``, which listens on every interface). Inside a SLURM allocation spanning several nodes it is one
torchrun per node (one srun task each) with c10d rendezvous at the allocation's first host: the endpoint and
rendezvous id come from WORLDPIPE_RDZV_ENDPOINT / WORLDPIPE_RDZV_ID (set by workflow/scripts/launch_training.sh).

torchrun and its workers die with this launcher (:mod:`worldpipe.launch.lifeline`); torchrun's stderr is relayed so
that a failure ends as one line (:mod:`worldpipe.launch.relay`). torchrun runs as :mod:`worldpipe.launch.torchrun`, whose
stores of a loopback rendezvous listen on 127.0.0.1 only.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path

from omegaconf import DictConfig

from worldpipe.config.paths import CONF_DIR
from worldpipe.core.errors import ERROR_LOG, debug_enabled
from worldpipe.core.last_words import ENV_VAR, LastWords
from worldpipe.launch.lifeline import die_with_parent, launcher_environment
from worldpipe.launch.local_run import run_in_process, runs_in_process
from worldpipe.launch.preflight import check_data, checked_config
from worldpipe.launch.relay import OutputRelay
from worldpipe.launch.run_lock import RunLock
from worldpipe.measure.startup import mark
from worldpipe.trainer.preemption import EXIT_PREEMPTED, PREEMPTED_RECORD

__all__ = ["launch_training", "main_env_endpoint", "torchrun_argv", "torchrun_command"]

LOOPBACK = "127.0.0.1"
# Seconds torchrun's agents wait for every node to join the rendezvous (a short start-up failure instead of
# ten minutes of waiting); `parallel.rdzv_timeout_s` overrides it.
RDZV_TIMEOUT_S = 120


def free_loopback_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the rendezvous store binds it a moment later)."""
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]


def torchrun_command(cfg: DictConfig, overrides: list[str], rdzv_endpoint: str | None = None,
                     rdzv_id: str | None = None, config_dir: Path = CONF_DIR) -> list[str]:
    """The torchrun command line for this config: c10d rendezvous, on 127.0.0.1 unless an endpoint is given.

    Overrides stay separate argv entries (never a shell string). ``config_dir`` holds Hydra's primary config:
    conf/ for a new run, a recorded config for a rerun.
    """
    primary = [] if Path(config_dir) == CONF_DIR else [f"--config-path={Path(config_dir).resolve()}",
                                                        "--config-name=config"]
    return torchrun_argv(int(cfg.parallel.nproc_per_node), int(cfg.parallel.nnodes),
                         [*primary, *overrides, f"hydra.run.dir={cfg.run_dir}"], rdzv_endpoint, rdzv_id,
                         int(cfg.parallel.get("rdzv_timeout_s") or RDZV_TIMEOUT_S))


def torchrun_argv(nproc: int, nnodes: int, worker_args: list[str], rdzv_endpoint: str | None = None,
                  rdzv_id: str | None = None, rdzv_timeout_s: int = RDZV_TIMEOUT_S) -> list[str]:
    """torchrun (as :mod:`worldpipe.launch.torchrun`) running :mod:`worldpipe.launch.worker` with ``worker_args``."""
    endpoint = rdzv_endpoint or f"{LOOPBACK}:{free_loopback_port()}"
    return [sys.executable, "-m", "worldpipe.launch.torchrun", f"--nproc-per-node={nproc}", f"--nnodes={nnodes}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={rdzv_id or _default_rdzv_id(rdzv_endpoint)}",
            f"--rdzv-conf=join_timeout={rdzv_timeout_s}", "--max-restarts=0",
            "-m", "worldpipe.launch.worker", *worker_args]


def _default_rdzv_id(rdzv_endpoint: str | None) -> str:
    # Nodes joining one explicit endpoint must agree on the id; a private loopback store needs no agreement.
    return "worldpipe" if rdzv_endpoint else uuid.uuid4().hex


def _holds_run_lock() -> bool:
    # One launcher per node under SLURM: the first task holds the lock for the whole job.
    return int(os.environ.get("SLURM_PROCID", "0")) == 0


def _early_run_dir(overrides: list[str], config_dir: Path) -> Path | None:
    """The run directory, known without composing the config when an override names it; else from a plain
    composition (no validation, no torch); None when even that fails (the full check then names the problem)."""
    from worldpipe.config.compose import check_override_syntax, compose_config

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


def launch_training(overrides: list[str], rdzv_endpoint: str | None = None, config_dir: Path = CONF_DIR) -> int:
    """Preflight, take the run lock, run torchrun, forward preemption signals.

    Returns torchrun's exit status (a failed worker's own status when torchrun reports it), or EXIT_PREEMPTED
    when the run stopped on a signal after checkpointing. Raises (ConfigError, DataMismatch, RunLocked,
    ResumeRefused, ...) before any process starts.
    """
    mark("launcher_start")
    lock = _lock_before_composing(overrides, config_dir) if _holds_run_lock() else None
    try:
        cfg = checked_config(overrides, config_dir)
        check_data(cfg)
        run_dir = Path(cfg.run_dir)
        if _holds_run_lock() and (lock is None or lock.path.parent.resolve() != run_dir.resolve()):
            if lock is not None:
                lock.release()
            run_dir.mkdir(parents=True, exist_ok=True)
            lock = RunLock(run_dir).acquire()
        # Imported only now: it brings torch (seconds), which the refusals above do not need.
        from worldpipe.trainer.resume import preflight_resume

        preflight_resume(cfg)
        # A record of an earlier preemption must not turn this attempt's failure into "preempted, retry me".
        (run_dir / PREEMPTED_RECORD).unlink(missing_ok=True)
        mark("config_composed")
        world_size = int(cfg.parallel.nproc_per_node) * int(cfg.parallel.nnodes)
        if runs_in_process(world_size, rdzv_endpoint):  # one process: no torchrun (worldpipe.launch.local_run)
            return run_in_process(cfg, overrides)
        cmd = torchrun_command(cfg, overrides, rdzv_endpoint, rdzv_id=os.environ.get("WORLDPIPE_RDZV_ID"),
                               config_dir=config_dir)
        return _run_torchrun(cmd, run_dir, int(cfg.parallel.nproc_per_node))
    finally:
        if lock is not None:
            lock.release()


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
        mark("torchrun_spawned")
        proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, env={**launcher_environment(), ENV_VAR: str(last_words.dir)},
                                preexec_fn=die_with_parent)  # noqa: PLW1509 - no threads run here yet
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


def main_env_endpoint() -> str | None:
    """Rendezvous endpoint from WORLDPIPE_RDZV_ENDPOINT (set by the SLURM launch script)."""
    return os.environ.get("WORLDPIPE_RDZV_ENDPOINT") or None
