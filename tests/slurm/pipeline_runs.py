"""Run the worldpipe Snakemake pipeline in a scratch directory, on the workstation or through the SLURM profile."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml
from localslurm import run

REPO = Path(__file__).resolve().parents[2]
SMOKE = REPO / "conf/pipeline/smoke.yaml"
TRAIN_DONE = "results/runs/smoke/train_done.json"
RUN_DIR = "results/runs/smoke"
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
    train_log = workdir / "logs/train_model/smoke.log"
    if train_log.exists():
        parts.append(f"--- {train_log.relative_to(workdir)}\n{train_log.read_text(errors='replace')[-4000:]}")
    if cluster is not None:
        parts.append(cluster.logs_tail(1500))
    return "\n".join(parts)
