"""Run the worldpipe Snakemake pipeline in a scratch directory, on the workstation or through the SLURM profile."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml
from localslurm import run

REPO = Path(__file__).resolve().parents[2]
SMOKE = REPO / "conf/pipeline/smoke.yaml"
# The run the pipeline started last (a symlink to its config-hash directory); a Snakemake target needs the
# hash directory itself: smoke_target().
RUN_DIR = "results/runs/smoke/latest"
TRAIN_DONE = f"{RUN_DIR}/train_done.json"
# Two SLURM jobs at a time on two cores; first status check after 2 s (squeue needs MinJobAge >= 3 x this).
SLURM_ARGS = ("--profile", str(REPO / "workflow/profiles/slurm"), "--jobs", "2",
              "--slurm-init-seconds-before-status-checks", "2", "--slurm-keep-successful-logs")
WORKSTATION_ARGS = ("--profile", str(REPO / "workflow/profiles/workstation"))


def snakemake_command(workdir: Path, configfiles: list[Path], *args: str) -> list[str]:
    return ["snakemake", "-s", str(REPO / "Snakefile"), "--directory", str(workdir),
            "--configfile", *map(str, configfiles), *args]


def run_snakemake(workdir: Path, env: dict, configfiles: list[Path], *args: str,
                  timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run(snakemake_command(workdir, configfiles, *args), env=env, capture_output=True, text=True,
                          timeout=timeout)


def start_snakemake(workdir: Path, env: dict, configfiles: list[Path], *args: str) -> subprocess.Popen:
    """Snakemake in the background, its output in workdir/snakemake.out."""
    out = open(workdir / "snakemake.out", "w")  # noqa: SIM115 - handed to the child
    try:
        return subprocess.Popen(snakemake_command(workdir, configfiles, *args), env=env, stdout=out,
                                stderr=subprocess.STDOUT)
    finally:
        out.close()


def smoke_target(configfiles: list[Path]) -> str:
    """The completion record of the smoke experiment's run under these config files (merged key by key)."""
    from snakemake.utils import update_config

    from worldpipe.pipeline.plan import plan

    config: dict = {}
    for path in configfiles:
        update_config(config, yaml.safe_load(Path(path).read_text()))
    return f"{plan(config, REPO / 'conf')[1]['smoke'].dir}/train_done.json"


def train_log(workdir: Path) -> Path:
    """The training log of the newest smoke run (logs/train_model/smoke-<run-hash>.log)."""
    logs = sorted((workdir / "logs/train_model").glob("smoke-*.log"), key=lambda p: p.stat().st_mtime)
    return logs[-1] if logs else workdir / "logs/train_model/smoke.log"


def smoke_dataset(workdir: Path) -> Path:
    """The smoke pipeline's training dataset directory (results/data/pendulum/<spec-hash>)."""
    return next((workdir / "results/data/pendulum").glob("*/manifest.json")).parent


def overlay_config(path: Path, **sections) -> Path:
    """A config file merged over smoke.yaml (Snakemake merges --configfile files key by key)."""
    path.write_text(yaml.safe_dump(sections))
    return path


def digest(run_dir: Path, env: dict) -> str:
    proc = subprocess.run(["worldpipe", "ckpt", "digest", str(run_dir)], env=env, capture_output=True, text=True,
                          timeout=300, check=True)
    return proc.stdout.strip().splitlines()[-1]


def latest_step(run_dir: Path) -> int:
    """Step of the newest published checkpoint (0 before the first)."""
    latest = run_dir / "checkpoints" / "latest"
    try:
        return int(latest.read_text().strip().rsplit("-", 1)[-1])
    except (FileNotFoundError, ValueError):
        return 0


def slurm_jobs(rule: str) -> list[tuple[str, str]]:
    """(job id, state) of this rule's jobs, oldest first (the plugin puts rule_<name>... in the comment)."""
    out = run(["squeue", "--states=all", "--noheader", "--format=%i|%T|%k"], check=False).stdout
    jobs = []
    for line in out.splitlines():
        job_id, state, comment = line.split("|", 2)
        if comment.startswith(f"rule_{rule}"):
            jobs.append((job_id, state))
    return sorted(jobs, key=lambda job: int(job[0]))


def failure_report(proc_output: str, workdir: Path, cluster=None) -> str:
    """What to read when a pipeline run failed: Snakemake's output, SLURM job logs, the training log."""
    parts = [proc_output[-6000:]]
    for log in sorted(workdir.glob(".snakemake/slurm_logs/**/*.log"))[-4:]:
        parts.append(f"--- {log.relative_to(workdir)}\n{log.read_text(errors='replace')[-3000:]}")
    log = train_log(workdir)
    if log.exists():
        parts.append(f"--- {log.relative_to(workdir)}\n{log.read_text(errors='replace')[-4000:]}")
    if cluster is not None:
        parts.append(cluster.logs_tail(1500))
    return "\n".join(parts)
