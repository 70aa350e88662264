"""Training inside a SLURM job: where `worldpipe train` runs, the job step it starts, the rendezvous of its nodes.

The pipeline's training rule runs in the job's batch step (its `mpi` resource tells the executor plugin not to
wrap the rule in a job step of its own). There training becomes a job step of its own: `srun` starts one
`worldpipe train` (one torchrun) per node; with several nodes they meet at a c10d rendezvous on the allocation's
first node. Being a step of its own, only training receives the warning signal the job asks for (`sbatch
--signal=USR1@T` is sent to every job step, never to the batch step), so Snakemake in the batch step sees a clean
exit 75. Already inside a job step (a plugin that wraps every rule in `srun -n1`), training runs right there, on
one node only.

The decisions are pure functions of `scontrol`'s answers and the environment (unit-tested); :func:`ask` is the
only place that runs `scontrol`. The allocation is asked of the controller because the plugin's job-step wrapper
strips SLURM_* from the environment (SLURM_JOB_ID is kept).
"""

from __future__ import annotations

import dataclasses
import subprocess
from collections.abc import Mapping, Sequence

from worldpipe.core.errors import UsageError

JOB_ID_ENV, STEP_ID_ENV = "SLURM_JOB_ID", "SLURM_STEP_ID"
RDZV_PORT_ENV = "WORLDPIPE_RDZV_PORT"
# Port of a multi-node rendezvous: one per job id (two jobs on one first node do not collide), above the
# well-known and registered ranges most services use.
RDZV_PORT_BASE, RDZV_PORT_SPAN = 20000, 20000
SCONTROL_TIMEOUT_S = 60

WORKSTATION, BATCH_STEP, JOB_STEP = "workstation", "batch step", "job step"

# Keys of the training rule's resources that become sbatch options through slurm_extra, not Snakemake resources.
TRAINING_SBATCH_KEYS = ("gpu", "gpus_per_node", "preempt_signal_s", "slurm_extra")


class SlurmRefused(UsageError):
    """Training cannot run the way the job was allocated (too few nodes, several nodes inside one job step)."""


@dataclasses.dataclass(frozen=True)
class Allocation:
    """What the controller says about the job: node count, CPUs per task, GPUs per node, node list."""

    job_id: str
    nodes: int
    cpus_per_task: int | None
    gres: str | None  # e.g. "gpu:4", for the step's --gres
    node_list: str


def placement(environ: Mapping[str, str]) -> str:
    """Where this process runs: WORKSTATION (no SLURM job), BATCH_STEP, or JOB_STEP (inside `srun`)."""
    if not environ.get(JOB_ID_ENV):
        return WORKSTATION
    return JOB_STEP if environ.get(STEP_ID_ENV) else BATCH_STEP


def parse_oneliner(text: str) -> dict[str, str]:
    """`scontrol show ... --oneliner` output as a dict (``Key=Value`` words; the first of a repeated key wins)."""
    fields: dict[str, str] = {}
    for word in text.split():
        key, sep, value = word.partition("=")
        if sep and key not in fields:
            fields[key] = value
    return fields


def allocation(job_id: str, job: Mapping[str, str]) -> Allocation:
    """The allocation from `scontrol show job --oneliner` fields; a pending range like ``1-2`` counts its minimum."""
    nodes = job.get("NumNodes", "")
    try:
        count = int(nodes.split("-", 1)[0])
    except ValueError:
        raise SlurmRefused(f"job {job_id}: scontrol reports NumNodes={nodes!r}, not a node count") from None
    cpus = job.get("CPUs/Task", "")
    tres = job.get("TresPerNode", "")
    # gres/gpu:4 (sbatch --gpus-per-node) or gres:gpu:4: the step asks for the node's GPUs explicitly.
    gres = tres.removeprefix("gres:").removeprefix("gres/") if "gpu" in tres else None
    return Allocation(job_id, count, int(cpus) if cpus.isdigit() else None, gres, job.get("NodeList", ""))


def check_nodes(where: str, nnodes: int, alloc: Allocation | None, environ: Mapping[str, str],
                rdzv_endpoint: str | None = None) -> None:
    """Refuse (SlurmRefused, one line) more nodes than allocated, or a multi-node run inside one job step that
    has no rendezvous to meet the other nodes at (the step `worldpipe train` starts passes one to every node)."""
    if where == JOB_STEP and nnodes > 1 and not rdzv_endpoint:
        raise SlurmRefused(f"parallel.nnodes={nnodes} but already inside job step {environ.get(JOB_ID_ENV)}."
                           f"{environ.get(STEP_ID_ENV)}; run the rule in the batch step (train_model's mpi resource)")
    if alloc is not None and alloc.nodes < nnodes:
        raise SlurmRefused(f"parallel.nnodes={nnodes} but job {alloc.job_id} has {alloc.nodes} node(s)")


def rendezvous(job_id: str, head: str, head_addr: str | None, environ: Mapping[str, str]) -> tuple[str, str]:
    """(endpoint, id) of the nodes' c10d rendezvous: the first node's NodeAddr (what other nodes reach, equal to
    its name on most clusters), port WORLDPIPE_RDZV_PORT or one derived from the job id, id ``slurm-<job id>``."""
    port = environ.get(RDZV_PORT_ENV) or str(RDZV_PORT_BASE + int(job_id) % RDZV_PORT_SPAN)
    return f"{head_addr or head}:{port}", f"slurm-{job_id}"


def step_argv(nnodes: int, alloc: Allocation, command: Sequence[str]) -> list[str]:
    """`srun` running ``command`` once per node as a job step of its own (one task per node)."""
    step = ["srun", f"--nodes={nnodes}", f"--ntasks={nnodes}", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    if alloc.cpus_per_task is not None:
        step.append(f"--cpus-per-task={alloc.cpus_per_task}")
    if alloc.gres:
        step.append(f"--gres={alloc.gres}")
    return [*step, *command]


def describe(nnodes: int, alloc: Allocation, endpoint: str | None) -> str:
    """The log line saying how training is started (the SLURM tests read it)."""
    return (f"worldpipe train: job {alloc.job_id}, training step on {nnodes} node(s), "
            f"{alloc.cpus_per_task if alloc.cpus_per_task is not None else '?'} CPUs per node, "
            f"rendezvous {endpoint or 'loopback'}")


def ask(*args: str) -> str:
    """`scontrol ARGS` (stdout); a failure is one line naming the command."""
    cmd = ["scontrol", *args]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=SCONTROL_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise SlurmRefused(f"{' '.join(cmd)}: {err}") from None
    if proc.returncode != 0:
        raise SlurmRefused(f"{' '.join(cmd)} failed (exit {proc.returncode}): {proc.stderr.strip()[-300:]}")
    return proc.stdout


def job_allocation(job_id: str) -> Allocation:
    """The allocation of ``job_id``, asked of the controller."""
    return allocation(job_id, parse_oneliner(ask("show", "job", "--oneliner", job_id)))


def first_node(alloc: Allocation) -> tuple[str, str | None]:
    """(name, NodeAddr) of the allocation's first node."""
    hosts = ask("show", "hostnames", alloc.node_list).split()
    if not hosts:
        raise SlurmRefused(f"job {alloc.job_id}: scontrol lists no host in NodeList={alloc.node_list!r}")
    return hosts[0], parse_oneliner(ask("show", "node", "--oneliner", hosts[0])).get("NodeAddr") or None


def training_job_resources(merged: Mapping[str, object], nnodes: int) -> dict[str, object]:
    """The training rule's Snakemake resources: one task per node on ``nnodes`` nodes, warning signal, GPUs.

    ``merged`` is the pipeline config's `resources.default` overridden by its `train_model` section. `mpi` is
    present (empty) so the executor plugin runs the rule in the batch step, and the training job step that
    `worldpipe train` starts is the only one the warning signal reaches; empty, it keeps the plugin's MPI check
    (tasks > 1) away from single-node jobs.
    """
    extra = ["--ntasks-per-node=1"]
    if int(merged.get("preempt_signal_s", 0) or 0) > 0:
        extra.append(f"--signal=USR1@{merged['preempt_signal_s']}")
    if int(merged.get("gpus_per_node", 0) or 0) > 0:
        extra.append(f"--gpus-per-node={merged['gpus_per_node']}")
    if merged.get("slurm_extra"):
        extra.append(str(merged["slurm_extra"]))
    plain = {key: value for key, value in merged.items() if key not in TRAINING_SBATCH_KEYS}
    return plain | {"nodes": nnodes, "tasks": nnodes, "mpi": "", "slurm_extra": " ".join(extra)}
