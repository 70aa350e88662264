"""Run the rollout service under uvicorn; SIGTERM stops accepting, finishes in-flight requests, then exits."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import uvicorn

from worldpipe.core.atomic import write_text_atomic
from worldpipe.rollout.http.app import BodyLimit, create_app
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


def serve(checkpoint_path: str, host: str = "127.0.0.1", port: int = 8000, config: ServiceConfig | None = None,
          port_file: str | None = None, device: str = "cpu") -> int:
    """Serve ``checkpoint_path`` until SIGTERM/SIGINT; returns the exit status."""
    config = config or ServiceConfig()
    app = BodyLimit(create_app(lambda: RolloutService(checkpoint_path, config, device)),
                    config.limits.max_request_bytes)
    server = _Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on",
                                    timeout_graceful_shutdown=None))
    server.port_file = Path(port_file) if port_file else None
    server.run()
    return 0 if server.started else 1
