"""A real SLURM cluster on localhost, from Debian's slurmctld/slurmd/slurm-client and munge.

One slurmctld and one slurmd per node name (`slurmd -N NAME`, each on its own port, all on 127.0.0.1):
ProctrackType=proctrack/linuxproc, TaskPlugin=task/none, no accounting (no slurmdbd, `sacct` does not
work: status queries go through squeue, so MinJobAge is an hour, longer than a test session), SelectType=select/cons_tres, no cgroups.

The config is written to /etc/slurm/slurm.conf because that is the only place a nested `srun` finds it:
the executor plugin's job-step wrapper strips every SLURM_* variable (SLURM_CONF included). An existing
file is moved aside and restored at stop(). Every daemon started here is stopped by its PID.

A cluster outlives nothing that owns it. Its daemons run in sessions of their own (a signal to the test run's
process group does not reach them) but die with the process that started them (``PR_SET_PDEATHSIG``), so a
test run killed by SIGKILL takes its cluster with it. Every daemon is also recorded, as it starts, in
:data:`STATE_FILE` (PID, start time, the moved-aside config); :meth:`LocalSlurmCluster.start` first reaps what
a previous run left there (and the daemons named by the PID files of a leftover config of ours), so a cluster
left behind never makes the next run skip. A controller that answers for a config that is not ours is never
touched: the cluster is then unavailable.

Also a small command line for working by hand:  python tests/slurm/localslurm.py up|down|status [--nodes N]
(`up` starts daemons that are not bound to the command, and the next test run reaps them.)
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__":  # by hand: the shared test helpers live one directory up
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from processes import is_alive, pids_with_env, wait_gone  # noqa: E402
from worldpipe.core.children import die_with_parent  # noqa: E402

SLURM_CONF = Path("/etc/slurm/slurm.conf")
CONF_MARKER = "# worldpipe test cluster (tests/slurm/localslurm.py); removed when the tests end"
# What a running test cluster holds: its daemons (pid, start time) and the config it moved aside.
STATE_FILE = Path("/run/worldpipe-test-slurm.json")
MUNGE_SOCKET_DIR = Path("/run/munge")
MUNGE_KEY = Path("/etc/munge/munge.key")
PACKAGES = ("slurm-wlm", "munge")
BINARIES = ("slurmctld", "slurmd", "sbatch", "srun", "squeue", "scontrol", "munged", "munge")
QUERY_TIMEOUT = 30


class ClusterUnavailable(RuntimeError):
    """The cluster cannot be brought up on this machine (not root, packages missing); tests skip."""


def run(cmd: list[str], timeout: float = QUERY_TIMEOUT, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
    """Run a scheduler command with a timeout (never wait on a wedged daemon forever)."""
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=check, **kwargs)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def binary(name: str) -> str:
    """Path of a SLURM or munge program (daemons live in /usr/sbin, not always on PATH)."""
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/bin") or name


def ensure_packages() -> None:
    """Install slurm-wlm and munge with apt when missing (root only); ClusterUnavailable otherwise."""
    missing = [b for b in BINARIES if binary(b) == b]
    if not missing:
        return
    if os.geteuid() != 0:
        raise ClusterUnavailable(f"SLURM binaries missing ({', '.join(missing)}) and not root to apt-get them")
    if shutil.which("apt-get") is None:
        raise ClusterUnavailable(f"SLURM binaries missing ({', '.join(missing)}) and no apt-get")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    try:
        run(["apt-get", "update", "-qq"], timeout=600, env=env)
        run(["apt-get", "install", "-y", "-qq", *PACKAGES], timeout=1200, env=env)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as err:
        out = getattr(err, "stderr", "") or ""
        raise ClusterUnavailable(f"apt-get install {' '.join(PACKAGES)} failed: {out[-500:]}") from err


def munge_works() -> bool:
    try:
        return run(["munge", "-n"], timeout=10, check=False).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def controller_answers() -> bool:
    """`scontrol ping` reaches the slurmctld named in /etc/slurm/slurm.conf."""
    try:
        return run(["scontrol", "ping"], timeout=10, check=False).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


class LocalSlurmCluster:
    """slurmctld + one slurmd per node name on 127.0.0.1; start() / stop(), or use as a context manager."""

    def __init__(self, workdir: Path, nodes: tuple[str, ...] = ("wp1",), cpus: int | None = None,
                 real_memory_mb: int = 4096, kill_wait: int = 30, partition: str = "debug",
                 bound: bool = True) -> None:
        self.workdir = Path(workdir)
        self.bound = bound  # daemons die with the process that started them
        self.nodes = nodes
        self.cpus = cpus or os.cpu_count() or 1
        self.real_memory_mb = real_memory_mb
        self.kill_wait = kill_wait
        self.partition = partition
        self.pids: dict[str, int] = {}
        self._procs: dict[str, subprocess.Popen] = {}
        self._conf_backup: Path | None = None
        self._wrote_conf = False
        self._made_conf_dir = False

    # ---- config ----
    def config_text(self) -> str:
        d = self.workdir
        host = socket.gethostname()
        ctld_port, slurmd_ports = free_port(), [free_port() for _ in self.nodes]
        self.ctld_port = ctld_port
        lines = [
            CONF_MARKER,
            "ClusterName=worldpipe",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            f"SlurmdPort={slurmd_ports[0]}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"StateSaveLocation={d}/state",
            f"SlurmdSpoolDir={d}/spool/%n",
            f"SlurmctldPidFile={d}/slurmctld.pid",
            f"SlurmdPidFile={d}/slurmd-%n.pid",
            f"SlurmctldLogFile={d}/slurmctld.log",
            f"SlurmdLogFile={d}/slurmd-%n.log",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core_Memory",
            "SchedulerType=sched/backfill",
            "SchedulerParameters=sched_interval=2",
            "MpiDefault=none",
            "SwitchType=switch/none",
            "ReturnToService=2",
            "MinJobAge=3600",  # finished jobs stay visible to squeue for the whole test session (no sacct here)
            f"KillWait={self.kill_wait}",
            "JobRequeue=1",
            "SlurmdParameters=config_overrides",  # several slurmd on one host each declare the host's CPUs
            "SlurmctldTimeout=30",
            "SlurmdTimeout=60",
            "InactiveLimit=0",
            "Waittime=0",
        ]
        for name, port in zip(self.nodes, slurmd_ports, strict=True):
            lines.append(f"NodeName={name} NodeAddr=127.0.0.1 NodeHostname={host} Port={port} "
                         f"CPUs={self.cpus} RealMemory={self.real_memory_mb} State=UNKNOWN")
        lines.append(f"PartitionName={self.partition} Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
        return "\n".join(lines) + "\n"

    def _install_conf(self) -> None:
        if not SLURM_CONF.parent.exists():
            SLURM_CONF.parent.mkdir(parents=True)
            self._made_conf_dir = True
        if SLURM_CONF.exists():
            self._conf_backup = SLURM_CONF.with_name(f"slurm.conf.worldpipe-backup-{os.getpid()}")
            SLURM_CONF.rename(self._conf_backup)
        SLURM_CONF.write_text(self.config_text())
        self._wrote_conf = True

    def _restore_conf(self) -> None:
        if self._wrote_conf:
            SLURM_CONF.unlink(missing_ok=True)
            self._wrote_conf = False
        if self._conf_backup is not None and self._conf_backup.exists():
            self._conf_backup.rename(SLURM_CONF)
            self._conf_backup = None

    # ---- daemons ----
    def _spawn(self, name: str, cmd: list[str], **kwargs) -> None:
        log = open(self.workdir / f"{name}.out", "ab")  # noqa: SIM115 - kept open by the daemon
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, preexec_fn=die_with_parent if self.bound else None,
                                **kwargs)  # noqa: PLW1509 - the fixture starts no threads
        log.close()
        self._procs[name] = proc
        self.pids[name] = proc.pid
        self._record_state()

    def _record_state(self) -> None:
        daemons = {name: {"pid": pid, "start": start_time(pid)} for name, pid in self.pids.items()}
        state = {"workdir": str(self.workdir), "conf_backup": str(self._conf_backup or ""), "daemons": daemons}
        tmp = STATE_FILE.with_name(f".{STATE_FILE.name}.{os.getpid()}")
        tmp.write_text(json.dumps(state))
        tmp.replace(STATE_FILE)

    def start(self, timeout: float = 60.0) -> LocalSlurmCluster:
        if os.geteuid() != 0:
            raise ClusterUnavailable("a local SLURM cluster needs root (slurmd runs jobs as their user)")
        ensure_packages()
        for line in reap_leftovers():
            print(f"localslurm: {line}", file=sys.stderr)
        if SLURM_CONF.exists() and controller_answers():
            # A cluster (a real one, or another test cluster) answers for this config: never take it over.
            raise ClusterUnavailable(f"a SLURM controller already answers for {SLURM_CONF}; not replacing it")
        self.workdir.mkdir(parents=True, exist_ok=True)
        for sub in ("state", "spool"):
            (self.workdir / sub).mkdir(exist_ok=True)
        try:
            if not munge_works():
                if not MUNGE_KEY.exists():  # normally created when the package is installed
                    run([binary("mungekey"), "--create", "--keyfile", str(MUNGE_KEY)])
                    shutil.chown(MUNGE_KEY, "munge", "munge")
                MUNGE_SOCKET_DIR.mkdir(parents=True, exist_ok=True)
                shutil.chown(MUNGE_SOCKET_DIR, "munge", "munge")
                self._spawn("munged", [binary("munged"), "--foreground"], user="munge", group="munge")
                self._wait(munge_works, timeout, "munged to answer `munge -n`")
            self._install_conf()
            self._record_state()  # the moved-aside config, before any daemon needs it
            self._spawn("slurmctld", [binary("slurmctld"), "-D", "-i"])
            self._wait(controller_answers, timeout,
                       "slurmctld to answer `scontrol ping`")
            for node in self.nodes:
                (self.workdir / "spool" / node).mkdir(exist_ok=True)
                self._spawn(f"slurmd-{node}", [binary("slurmd"), "-D", "-N", node])
            self._wait(self.nodes_idle, timeout, f"nodes {','.join(self.nodes)} to be idle")
        except BaseException:
            self.stop()
            raise
        return self

    def _wait(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, proc in self._procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode} while waiting for {what}:\n"
                                       + self.logs_tail())
            if ready():
                return
            time.sleep(0.5)
        raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}:\n" + self.logs_tail())

    def node_states(self) -> dict[str, str]:
        out = run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False, timeout=10)
        states = {}
        for line in out.stdout.splitlines():
            parts = line.split()
            if len(parts) == 2:
                states[parts[0]] = parts[1]
        return states

    def nodes_idle(self) -> bool:
        states = self.node_states()
        return all(states.get(node, "").rstrip("*") in ("idle", "mix", "alloc") for node in self.nodes)

    def cancel_all(self) -> None:
        """Cancel every job and wait (up to KillWait + 30 s) until their processes are gone."""
        try:
            run(["scancel", "--full", "--partition", self.partition], check=False, timeout=15)
            wait_for(lambda: not active_jobs(), self.kill_wait + 30, "cancelled jobs to end", interval=1)
        except (subprocess.TimeoutExpired, TimeoutError):
            pass  # stopping the daemons anyway

    def logs_tail(self, chars: int = 3000) -> str:
        parts = []
        for path in sorted(self.workdir.glob("*.log")) + sorted(self.workdir.glob("*.out")):
            text = path.read_text(errors="replace")
            parts.append(f"--- {path.name}\n{text[-chars:]}")
        return "\n".join(parts)

    def stop(self) -> None:
        """Cancel what is left, stop every daemon started here (by PID), restore /etc/slurm/slurm.conf."""
        if "slurmctld" in self._procs and self._procs["slurmctld"].poll() is None:
            self.cancel_all()
        order = [n for n in self._procs if n.startswith("slurmd-")] + ["slurmctld", "munged"]
        for name in order:
            proc = self._procs.get(name)
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        self._procs.clear()
        # proctrack/linuxproc follows parents: a job's process whose parent exited (a job step hung at exit, a
        # setsid) is no longer the job's and survives scancel and slurmd. Every process a job of this cluster
        # started carries the controller's port in its environment; those still running stop here, by PID.
        if getattr(self, "ctld_port", None) is not None:
            _stop_pids(job_processes(self.ctld_port))
        self._restore_conf()
        STATE_FILE.unlink(missing_ok=True)

    def __enter__(self) -> LocalSlurmCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# ---- leftovers of an interrupted run ----
def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (tells a recorded PID from a reused one)."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _ours(conf: Path) -> bool:
    try:
        return conf.read_text().startswith(CONF_MARKER)
    except OSError:
        return False


def _pid_file_daemons(conf: Path) -> list[int]:
    """PIDs in the PID files a config of ours names (slurmctld, one slurmd per node): a run before STATE_FILE."""
    keys = dict(line.split("=", 1) for line in conf.read_text().splitlines() if "=" in line and " " not in line)
    nodes = [line.split()[0].split("=", 1)[1] for line in conf.read_text().splitlines() if line.startswith("NodeName=")]
    files = [keys.get("SlurmctldPidFile", "")] + [keys.get("SlurmdPidFile", "").replace("%n", n) for n in nodes]
    pids = []
    for name in filter(None, files):
        with contextlib.suppress(OSError, ValueError):
            pids.append(int(Path(name).read_text().split()[0]))
    return pids


def job_processes(ctld_port: int) -> set[int]:
    """PIDs of the processes started by jobs of the cluster whose controller listens on ``ctld_port``
    (``SLURM_WORKING_CLUSTER=<name>:<host>:<port>:...`` in their environment), wherever they were reparented."""
    return pids_with_env("SLURM_WORKING_CLUSTER", lambda value: value.split(":")[2:3] == [str(ctld_port)])


def _stop_pids(pids: set[int]) -> set[int]:
    """SIGTERM (to the process group each daemon leads), SIGKILL after 20 s; returns what did not die."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in {p for p in pids if is_alive(p)}:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, sig) if os.getpgid(pid) == pid else os.kill(pid, sig)
        if not wait_gone(pids, timeout=20):
            return set()
    return {p for p in pids if is_alive(p)}


def reap_leftovers() -> list[str]:
    """Stop the daemons a previous test cluster left running and put /etc/slurm/slurm.conf back as it was.

    Only what is ours: the PIDs recorded in STATE_FILE (with their start times) and, when the installed config
    carries our marker, the PIDs in the PID files it names. Returns a line per thing done (empty: nothing left).
    """
    done, pids = [], set()
    state = json.loads(STATE_FILE.read_text()) if STATE_FILE.exists() else {}
    for name, daemon in state.get("daemons", {}).items():
        if is_alive(daemon["pid"]) and start_time(daemon["pid"]) == daemon["start"]:
            pids.add(daemon["pid"])
            done.append(f"stopping {name} (pid {daemon['pid']}) left by an interrupted run")
    if _ours(SLURM_CONF):
        for pid in set(_pid_file_daemons(SLURM_CONF)) - pids:
            if is_alive(pid):
                pids.add(pid)
                done.append(f"stopping pid {pid} named by the PID files of a leftover {SLURM_CONF}")
    survivors = _stop_pids(pids)
    if survivors:
        raise RuntimeError(f"daemons of a previous test cluster survived SIGKILL: {sorted(survivors)}")
    if _ours(SLURM_CONF):
        SLURM_CONF.unlink()
        done.append(f"removed the leftover test config {SLURM_CONF}")
    backup = Path(state["conf_backup"]) if state.get("conf_backup") else None
    if backup is not None and backup.exists() and not SLURM_CONF.exists():
        backup.rename(SLURM_CONF)
        done.append(f"restored {SLURM_CONF} from {backup}")
    STATE_FILE.unlink(missing_ok=True)
    return done


# ---- jobs ----
JOB_END_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
                  "DEADLINE", "PREEMPTED"}


def sbatch(*args: str, cwd: Path | None = None) -> str:
    """Submit; returns the job id."""
    return run(["sbatch", "--parsable", *args], cwd=cwd).stdout.strip().split(";")[0]


def job_state(job_id: str) -> str:
    """The job's state as squeue reports it ('' once the controller forgot it; MinJobAge is 3600 s here)."""
    out = run(["squeue", "--states=all", "--noheader", "--format=%T", "--jobs", job_id], check=False)
    return out.stdout.strip()


def job_field(job_id: str, name: str) -> str:
    """One field of `scontrol show job` (e.g. Restarts, ExitCode, NodeList)."""
    out = run(["scontrol", "show", "job", "--oneliner", job_id], check=False).stdout
    for token in out.split():
        if token.startswith(f"{name}="):
            return token.split("=", 1)[1]
    return ""


def active_jobs() -> list[str]:
    """Jobs that still hold resources or processes (pending, running, completing, ...)."""
    out = run(["squeue", "--noheader", "--format=%i"], check=False)
    return out.stdout.split()


def wait_for(predicate, timeout: float, what: str, interval: float = 0.5):
    """Poll `predicate` until it returns something truthy; TimeoutError after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def wait_job_end(job_id: str, timeout: float = 120) -> str:
    """Wait until the job reached a final state; returns it."""
    return wait_for(lambda: (lambda s: s if s in JOB_END_STATES else None)(job_state(job_id)), timeout,
                    f"job {job_id} to end")


# ---- by hand: daemons outlive the command (not bound to it); STATE_FILE records them ----
def _main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("up", "down", "status"))
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "worldpipe-slurm")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--kill-wait", type=int, default=30)
    args = parser.parse_args(argv)
    if args.action == "up":
        if STATE_FILE.exists():
            parser.error(f"{STATE_FILE} exists: run `down` first")
        cluster = LocalSlurmCluster(args.workdir, nodes=tuple(f"wp{i + 1}" for i in range(args.nodes)),
                                    kill_wait=args.kill_wait, bound=False)
        t0 = time.monotonic()
        cluster.start()
        print(f"up in {time.monotonic() - t0:.1f} s: {cluster.pids}; {cluster.node_states()}")
    elif args.action == "status":
        print(STATE_FILE.read_text() if STATE_FILE.exists() else "down")
        print(run(["sinfo"], check=False).stdout)
    else:
        if STATE_FILE.exists() and controller_answers():
            run(["scancel", "--full", "--partition", "debug"], check=False, timeout=15)
        for line in reap_leftovers():
            print(line)
        shutil.rmtree(args.workdir, ignore_errors=True)  # slurmctld would recover old jobs from its state
        print("down")
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
