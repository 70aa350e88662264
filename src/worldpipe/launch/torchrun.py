"""torchrun, the one way: :func:`torchrun_argv` builds every torchrun command line (training, benchmarks, tests),
and `python -m worldpipe.launch.torchrun ARGS` is the torchrun it runs, with its stores on loopback only when asked.

The command line always uses a c10d rendezvous, on 127.0.0.1 at a free port unless a multi-node endpoint is
given; never ``--standalone``, which listens on every interface. torchrun's TCP stores (the c10d rendezvous store and the store it hands to the workers) bind every interface
whatever host they are given, and answer anyone without authentication. When the rendezvous endpoint is a
loopback address (a run on one workstation), this entry point creates each store's listening socket itself,
bound to 127.0.0.1, and gives it to the store (``master_listen_fd``). Multi-node runs (an endpoint on a real
interface) are untouched. Everything else is torchrun's own ``main``.
"""

from __future__ import annotations

import ipaddress
import socket
import sys
import uuid
from collections.abc import Sequence

LOOPBACK = "127.0.0.1"
# Seconds torchrun's agents wait for every node to join the rendezvous (a short start-up failure instead of
# ten minutes of waiting); the training config's `parallel.rdzv_timeout_s` overrides it.
RDZV_TIMEOUT_S = 120
_TCPSTORE_ARGS = ("host_name", "port", "world_size", "is_master", "timeout", "wait_for_workers", "multi_tenant",
                  "master_listen_fd", "use_libuv")


def free_loopback_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the rendezvous store binds it a moment later)."""
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]


def torchrun_argv(nproc_per_node: int, program: Sequence[str], nnodes: int = 1, rdzv_endpoint: str | None = None,
                  rdzv_id: str | None = None, rdzv_timeout_s: int = RDZV_TIMEOUT_S) -> list[str]:
    """The command line running ``program`` on ``nproc_per_node`` ranks per node under this torchrun.

    ``program`` is what torchrun runs on each rank: ``["-m", "package.module", *args]`` or ``[script, *args]``.
    The rendezvous is c10d at ``rdzv_endpoint`` (multi-node: every node gives the same endpoint and id), else at
    a free port on 127.0.0.1 whose stores listen on loopback only.
    """
    endpoint = rdzv_endpoint or f"{LOOPBACK}:{free_loopback_port()}"
    # Nodes joining one explicit endpoint must agree on the id; a private loopback store needs no agreement.
    rdzv_id = rdzv_id or ("worldpipe" if rdzv_endpoint else uuid.uuid4().hex)
    return [sys.executable, "-m", "worldpipe.launch.torchrun", f"--nproc-per-node={nproc_per_node}",
            f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={rdzv_id}",
            f"--rdzv-conf=join_timeout={rdzv_timeout_s}", "--max-restarts=0", *program]


def is_loopback(host: str) -> bool:
    """True for 'localhost' and loopback IP addresses."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def loopback_listener(port: int) -> int:
    """A listening TCP socket on 127.0.0.1:``port``; returns its file descriptor (the caller owns it)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((LOOPBACK, port))
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        raise
    return sock.detach()


def install_loopback_stores() -> None:
    """Make every TCPStore server created in this process for a loopback host listen on 127.0.0.1 only."""
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend

    original = dist.TCPStore
    if getattr(original, "_worldpipe_loopback", False):
        return

    class LoopbackTCPStore(original):
        _worldpipe_loopback = True

        def __init__(self, *args, **kwargs):
            kwargs.update(zip(_TCPSTORE_ARGS, args, strict=False))
            if (kwargs.get("is_master") and kwargs.get("master_listen_fd") is None
                    and is_loopback(str(kwargs.get("host_name", "")))):
                try:
                    kwargs["master_listen_fd"] = loopback_listener(int(kwargs["port"]))
                except OSError as exc:
                    # Another agent on this machine (e.g. a second "node" of one host) already hosts the store.
                    # torch's rendezvous answers a RuntimeError here by joining that store as a client, as it
                    # does when its own TCPStore server cannot bind.
                    raise RuntimeError(f"cannot listen on 127.0.0.1:{kwargs['port']}: {exc}") from exc
            super().__init__(**kwargs)

    dist.TCPStore = LoopbackTCPStore
    c10d_rendezvous_backend.TCPStore = LoopbackTCPStore


def main() -> None:
    """Run torchrun with ``sys.argv[1:]``; stores of a loopback rendezvous listen on 127.0.0.1 only."""
    from worldpipe.measure.startup import mark

    mark("torchrun_main")
    install_loopback_stores()
    from torch.distributed.run import main as torchrun_main

    torchrun_main(sys.argv[1:])


if __name__ == "__main__":
    main()
    # Finished with every worker gone: exit without the final collections over torch's objects
    # (worldpipe.core.process_exit). A failure raises out of main() above and ends as torchrun's own would.
    from worldpipe.core.process_exit import exit_process

    exit_process(0)
