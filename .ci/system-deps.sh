#!/usr/bin/env bash
# Install the Debian packages the test suite drives for real. Skips what is already there; needs root.
set -euo pipefail
needed=()
command -v strace >/dev/null || needed+=(strace)
command -v fiu-run >/dev/null || needed+=(fiu-utils)
command -v chromium >/dev/null || needed+=(chromium)
# `snakemake --dag | dot -Tpng` (docs/getting-started.md) draws the DAG with graphviz
command -v dot >/dev/null || needed+=(graphviz)
# a real PostgreSQL for the tracking-server test (Debian keeps initdb/pg_ctl under /usr/lib/postgresql/<v>/bin)
compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null || needed+=(postgresql)
# a real SLURM cluster on localhost for tests/slurm (slurmctld, slurmd, client commands) and its auth daemon
{ command -v slurmctld && command -v slurmd && command -v sbatch; } >/dev/null || needed+=(slurm-wlm)
# FUSE for the crash-simulating file system of tests/crashfs (libfuse3 and fusermount3)
{ command -v fusermount3 && compgen -G "/usr/lib/*/libfuse3.so.3"; } >/dev/null || needed+=(fuse3)
{ command -v munged && command -v munge; } >/dev/null || needed+=(munge)
if [ ${#needed[@]} -eq 0 ]; then exit 0; fi
if [ "$(id -u)" -ne 0 ]; then
    echo "system-deps: missing ${needed[*]} and not root; the tests that need them skip (and make test fails: it runs pytest --no-skips)" >&2
    exit 0
fi
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${needed[@]}" >/dev/null
