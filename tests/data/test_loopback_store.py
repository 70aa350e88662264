"""worldpipe.launch.torchrun's loopback stores: a second host on one machine joins as a client instead of failing.

Two SLURM "nodes" on one host both see the loopback rendezvous endpoint as their own; torch's rendezvous
tries to host the store from each and falls back to a client when hosting raises RuntimeError. Run in a
subprocess: installing the loopback stores patches torch.distributed for the whole process.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

CHILD = textwrap.dedent("""
    import socket
    from datetime import timedelta
    import torch.distributed as dist
    from worldpipe.launch.torchrun import install_loopback_stores

    install_loopback_stores()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    try:
        dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    except RuntimeError as err:
        print("second host refused:", "cannot listen" in str(err))
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    server.set("k", "v")
    print("client reads:", client.get("k").decode())
""")


def test_a_second_loopback_host_raises_runtime_error_and_a_client_still_joins():
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "second host refused: True" in proc.stdout
    assert "client reads: v" in proc.stdout
