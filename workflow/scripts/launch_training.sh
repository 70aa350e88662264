#!/usr/bin/env bash
# Start training on this machine or across a SLURM allocation; arguments are Hydra overrides.
# Inside a multi-node allocation every node runs one torchrun (via srun) that meets the others at a c10d
# rendezvous on the allocation's first host; elsewhere `worldpipe train` runs torchrun --standalone.
set -euo pipefail
if [[ -n "${SLURM_JOB_ID:-}" && "${SLURM_JOB_NUM_NODES:-1}" -gt 1 ]]; then
    head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
    export WORLDPIPE_RDZV_ENDPOINT="${head}:${WORLDPIPE_RDZV_PORT:-29500}"
    exec srun --ntasks-per-node=1 --kill-on-bad-exit=1 worldpipe train "$@"
fi
exec worldpipe train "$@"
