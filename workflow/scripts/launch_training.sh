#!/usr/bin/env bash
# Start training on this machine or across a SLURM allocation; arguments are Hydra overrides.
#
# Workstation (no SLURM_JOB_ID): `worldpipe train` runs torchrun --standalone (or joins the c10d rendezvous in
# WORLDPIPE_RDZV_ENDPOINT, for a multi-node run started by hand).
#
# SLURM batch step (the train_model rule runs there: its `mpi` resource tells the executor plugin not to wrap the
# rule in a job step of its own): training becomes its own job step. `srun` starts one `worldpipe train` (one
# torchrun) per node; with several nodes they meet at a c10d rendezvous on the allocation's first node. Being a
# step of its own, only training receives the warning signal the job asks for (`sbatch --signal=USR1@T`: it is
# sent to every job step, never to the batch step), so Snakemake in the batch step sees a clean exit 75.
#
# Already inside a job step (SLURM_STEP_ID set, e.g. a plugin that wraps every rule in `srun -n1`): one node only,
# run torchrun here.
set -euo pipefail

nnodes=1
for arg in "$@"; do
    case "$arg" in parallel.nnodes=*) nnodes="${arg#parallel.nnodes=}" ;; esac
done

if [[ -z "${SLURM_JOB_ID:-}" || -n "${SLURM_STEP_ID:-}" ]]; then
    if [[ -n "${SLURM_STEP_ID:-}" && "$nnodes" -gt 1 ]]; then
        echo "launch_training: parallel.nnodes=$nnodes but already inside job step $SLURM_JOB_ID.$SLURM_STEP_ID;" \
             "run the rule in the batch step (train_model's mpi resource)" >&2
        exit 2
    fi
    exec worldpipe train "$@"
fi

# The allocation, asked of the controller: the plugin's job-step wrapper strips SLURM_* from our environment
# (SLURM_JOB_ID is kept), and srun itself only finds the cluster through the default slurm.conf.
job=$(scontrol show job --oneliner "$SLURM_JOB_ID")
field() { tr ' ' '\n' <<<"$1" | sed -n "s|^$2=||p" | head -n 1; }
alloc_nodes=$(field "$job" NumNodes)
cpus_per_task=$(field "$job" CPUs/Task)
tres_per_node=$(field "$job" TresPerNode)
if [[ "${alloc_nodes%%-*}" -lt "$nnodes" ]]; then
    echo "launch_training: parallel.nnodes=$nnodes but job $SLURM_JOB_ID has $alloc_nodes node(s)" >&2
    exit 2
fi
step=(srun --nodes="$nnodes" --ntasks="$nnodes" --ntasks-per-node=1 --kill-on-bad-exit=1)
[[ "$cpus_per_task" =~ ^[0-9]+$ ]] && step+=(--cpus-per-task="$cpus_per_task")
if [[ "$tres_per_node" == *gpu* ]]; then
    # e.g. gres:gpu:4 or gres/gpu:4 (sbatch --gpus-per-node): the step takes the node's GPUs explicitly.
    step+=(--gres="${tres_per_node#gres[:/]}")
fi

if [[ "$nnodes" -gt 1 ]]; then
    head=$(scontrol show hostnames "$(field "$job" NodeList)" | head -n 1)
    # NodeAddr is what other nodes can reach (equal to the node name on most clusters).
    addr=$(field "$(scontrol show node --oneliner "$head")" NodeAddr)
    port="${WORLDPIPE_RDZV_PORT:-$((20000 + SLURM_JOB_ID % 20000))}"
    export WORLDPIPE_RDZV_ENDPOINT="${addr:-$head}:${port}"
    export WORLDPIPE_RDZV_ID="slurm-${SLURM_JOB_ID}"
fi
echo "launch_training: job $SLURM_JOB_ID, training step on $nnodes node(s), ${cpus_per_task:-?} CPUs per node," \
     "rendezvous ${WORLDPIPE_RDZV_ENDPOINT:-standalone}" >&2
exec "${step[@]}" worldpipe train "$@"
