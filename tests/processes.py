"""Process-tree facts read from /proc, for tests that kill launchers and look for survivors."""

from __future__ import annotations

import os
import time
from pathlib import Path


def pids_with_arg(fragment: str, cwd: Path | None = None) -> set[int]:
    """PIDs of live processes with an argv entry containing ``fragment`` (e.g. a unique run_dir).

    ``cwd``: only processes working below that directory. A Snakemake job's argv names paths relative to the
    working directory, so a run hash alone also matches another test's pipeline of the same config.
    """
    found = set()
    for entry in _processes():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            if cwd is not None and not Path(os.readlink(entry / "cwd")).is_relative_to(cwd):
                continue
        except OSError:
            continue
        if any(fragment.encode() in arg for arg in argv) and is_alive(int(entry.name)):
            found.add(int(entry.name))
    return found


def pids_with_env(variable: str, matches) -> set[int]:
    """PIDs of live processes whose environment sets ``variable`` to a value for which ``matches(value)`` holds
    (the environment they started with: what they inherited, wherever they were reparented since)."""
    prefix = f"{variable}=".encode()
    found = set()
    for entry in _processes():
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        value = next((item[len(prefix):] for item in environ if item.startswith(prefix)), None)
        if value is not None and matches(value.decode(errors="replace")) and is_alive(int(entry.name)):
            found.add(int(entry.name))
    return found


def _processes():
    """The /proc entries of processes."""
    return (entry for entry in Path("/proc").iterdir() if entry.name.isdigit())


def is_alive(pid: int) -> bool:
    """True while any thread of process ``pid`` is running (neither a zombie nor gone).

    Threads, not just the main one: a killed multi-threaded process (torchrun, with its store and monitor
    threads) shows its leader as a zombie while other threads are still exiting, and its open files (a run
    lock's flock among them) are released only when the last thread has gone.
    """
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    for tid in threads:
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue
        if stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X"):
            return True
    return False


def wait_gone(pids: set[int], timeout: float = 30.0) -> set[int]:
    """Wait until none of ``pids`` is alive; returns the survivors after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = {p for p in pids if is_alive(p)}
        if not alive:
            return set()
        time.sleep(0.05)
    return {p for p in pids if is_alive(p)}


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[len("socket:["):-1])
    except OSError:
        pass
    return inodes


def _hex_address(text: str) -> str:
    address, port = text.split(":")
    if len(address) == 8:  # IPv4, little-endian
        return ".".join(str(int(address[i:i + 2], 16)) for i in (6, 4, 2, 0)) + f":{int(port, 16)}"
    return f"[{address}]:{int(port, 16)}"


def listening_addresses(pids: set[int]) -> list[str]:
    """Local addresses of the TCP sockets in LISTEN state owned by ``pids`` (IPv4 as a.b.c.d:port)."""
    inodes = set().union(*(_socket_inodes(p) for p in pids)) if pids else set()
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: TCP_LISTEN
                found.append(_hex_address(fields[1]))
    return found


def snapshot_dir(path: Path) -> dict[str, int]:
    """Names and inode numbers under a directory (a replaced file or directory shows as a changed inode)."""
    if not path.exists():
        return {}
    return {p.name: p.stat().st_ino for p in path.iterdir()}
