"""Run the rollout service under uvicorn; SIGTERM stops accepting, finishes in-flight requests, then exits."""

from __future__ import annotations

import gc
import ipaddress
import logging
import os
import re
import socket
from pathlib import Path

import uvicorn

from worldpipe.core.atomic import write_text_atomic
from worldpipe.core.errors import UsageError
from worldpipe.rollout.contexts import HeldoutContexts
from worldpipe.rollout.http.app import BodyLimit, ServerTiming, create_app
from worldpipe.rollout.service import RolloutService, ServiceConfig

log = logging.getLogger("worldpipe.rollout.http")


class _Server(uvicorn.Server):
    """uvicorn's server, announcing the bound address (``--port 0`` picks a free port)."""

    port_file: Path | None = None

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started and self.servers:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            log.info("serving on http://%s:%d (pid %d)", host, port, os.getpid())
            if self.port_file is not None:
                write_text_atomic(self.port_file, f"{port}\n")

    async def shutdown(self, sockets=None) -> None:
        await super().shutdown(sockets)
        # uvicorn re-raises a captured SIGTERM after draining, which would end the process "killed by signal";
        # a drained shutdown is a clean exit.
        self._captured_signals.clear()


def listen_socket(host: str, port: int) -> socket.socket:
    """A socket bound to ``host``:``port`` (not yet listening); raises UsageError naming the option at fault.

    Done before the model loads, so a bad address costs the user nothing. ``port`` 0 picks a free one.
    """
    if not 0 <= port <= 65535:
        raise UsageError(f"--port {port}: must be 0..65535")
    if re.fullmatch(r"[0-9.]+", host):  # an IPv4 literal, never a name to look up ("999.1.1.1")
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            raise UsageError(f"--host {host}: not an IPv4 address") from None
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as exc:
        raise UsageError(f"--host {host}: cannot resolve it ({getattr(exc, 'strerror', None) or exc})") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn would: restart past TIME_WAIT
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise UsageError(f"--host {host} --port {port}: cannot listen there ({exc.strerror or exc})") from None
    return sock


def serve(checkpoint_path: str, host: str = "127.0.0.1", port: int = 8000, config: ServiceConfig | None = None,
          port_file: str | None = None, device: str = "cpu", contexts: HeldoutContexts | None = None) -> int:
    """Serve ``checkpoint_path`` until SIGTERM/SIGINT; returns the exit status.

    The address is claimed and the model loaded (and checked against ``contexts``, the held-out windows the play
    page starts sessions from) before uvicorn starts: a bad host, port, held-out dataset or checkpoint directory
    is one error line (UsageError, CheckpointError), never a traceback from inside the server.
    """
    config = config or ServiceConfig()
    sock = listen_socket(host, port)
    try:
        service = RolloutService(checkpoint_path, config, device)
        if contexts is not None:
            latest = service.registry.latest()
            contexts.observed_by(latest.model.observation_key)
            contexts.check_dims(latest.obs_dim, latest.act_dim, f"the model at {checkpoint_path}")
    except BaseException:
        sock.close()
        raise
    fastapi_app = create_app(lambda: service)
    fastapi_app.state.heldout = contexts
    app = ServerTiming(BodyLimit(fastapi_app, config.limits.max_request_bytes))
    server = _Server(uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=None))
    server.port_file = Path(port_file) if port_file else None
    # Everything loaded so far (torch, FastAPI, the model) lives as long as the server: out of the collector's
    # sight, a full collection walks only what requests allocate, instead of pausing a request for the whole heap.
    gc.collect()
    gc.freeze()
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    return 0 if server.started else 1
