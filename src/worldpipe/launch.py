"""Start training under torchrun: compose and validate the config first, then one process per rank.

On a workstation this is `torchrun --standalone`; inside a SLURM allocation spanning several nodes it is one
torchrun per node (one srun task each) with c10d rendezvous at the allocation's first host: the endpoint and
rendezvous id come from WORLDPIPE_RDZV_ENDPOINT / WORLDPIPE_RDZV_ID (set by workflow/scripts/launch_training.sh).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from worldpipe.config import validate_config
from worldpipe.local_run import run_in_process, runs_in_process
from worldpipe.measure.startup import mark
from worldpipe.paths import CONF_DIR
from worldpipe.preemption import EXIT_PREEMPTED, PREEMPTED_RECORD
from worldpipe.resume import preflight_resume


def compose_config(overrides: list[str], config_dir: Path = CONF_DIR) -> DictConfig:
    """The resolved training config for these Hydra overrides (raises on unknown groups or keys).

    ``config_dir`` holds the primary ``config.yaml``: conf/ for a new run, a recorded config for a rerun.
    """
    with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def torchrun_command(cfg: DictConfig, overrides: list[str], rdzv_endpoint: str | None = None,
                     rdzv_id: str = "worldpipe", config_dir: Path = CONF_DIR) -> list[str]:
    """The torchrun command line for this config (standalone for one node, c10d rendezvous for several)."""
    nproc, nnodes = int(cfg.parallel.nproc_per_node), int(cfg.parallel.nnodes)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}"]
    if nnodes == 1 and rdzv_endpoint is None:
        cmd.append("--standalone")
    else:
        cmd += [f"--nnodes={nnodes}", "--rdzv_backend=c10d", f"--rdzv_endpoint={rdzv_endpoint}", f"--rdzv_id={rdzv_id}"]
    cmd += ["-m", "worldpipe.train"]
    if Path(config_dir) != CONF_DIR:
        cmd += [f"--config-path={Path(config_dir).resolve()}", "--config-name=config"]
    return cmd + [*overrides, f"hydra.run.dir={cfg.run_dir}"]


def launch_training(overrides: list[str], rdzv_endpoint: str | None = None, config_dir: Path = CONF_DIR) -> int:
    """Validate config and resume identity, run torchrun, forward preemption signals.

    Returns torchrun's exit status, or EXIT_PREEMPTED when the run stopped on a signal after checkpointing.
    Raises ConfigError or ResumeRefused before any process starts.
    """
    mark("launcher_start")
    cfg = compose_config(overrides, config_dir)
    world_size = int(cfg.parallel.nproc_per_node) * int(cfg.parallel.nnodes)
    validate_config(cfg, world_size)
    preflight_resume(cfg)
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    # A record of an earlier preemption must not turn this attempt's failure into "preempted, retry me".
    (run_dir / PREEMPTED_RECORD).unlink(missing_ok=True)
    mark("config_composed")
    if runs_in_process(world_size, rdzv_endpoint):
        return run_in_process(cfg, overrides)
    cmd = torchrun_command(cfg, overrides, rdzv_endpoint, rdzv_id=os.environ.get("WORLDPIPE_RDZV_ID") or "worldpipe",
                           config_dir=config_dir)
    # torchrun does not handle SIGUSR1 and would die of it; SLURM sends the warning signal to every process of
    # the job step, torchrun included. An ignored disposition survives exec, so torchrun starts with SIGUSR1
    # ignored; the workers install their own handler (PreemptionFlag).
    previous = {signal.SIGUSR1: signal.signal(signal.SIGUSR1, signal.SIG_IGN)}
    try:
        mark("torchrun_spawned")
        proc = subprocess.Popen(cmd)
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
    try:
        code = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if code != 0 and (run_dir / PREEMPTED_RECORD).exists():
        return EXIT_PREEMPTED
    if code != 0 and any(sig in (signal.SIGTERM, signal.SIGUSR1) for sig in received):
        # Stopped on a preemption signal. On another node than rank 0's, torchrun may end before rank 0 has
        # written PREEMPTED; the run resumes from its newest intact checkpoint either way.
        return EXIT_PREEMPTED
    return code


def main_env_endpoint() -> str | None:
    """Rendezvous endpoint from WORLDPIPE_RDZV_ENDPOINT (set by the SLURM launch script)."""
    return os.environ.get("WORLDPIPE_RDZV_ENDPOINT") or None
