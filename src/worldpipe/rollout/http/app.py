"""The FastAPI app: rollouts, sessions, health, stats; OpenAPI docs at /docs, /redoc and /openapi.json (offline).

Handlers are plain functions, so FastAPI runs them on its worker threads; each blocks on its job's future
while the batcher thread computes, and many requests wait in the batcher at once. Errors a client can cause
answer 4xx with the field or session named; never a traceback.
"""

from __future__ import annotations

import base64
import binascii
import time
from collections.abc import Callable
from contextlib import asynccontextmanager

import anyio.to_thread
import numpy as np
import torch
from fastapi import FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi_offline import FastAPIOffline

from worldpipe.rollout.engine import Sampling
from worldpipe.rollout.http.play import register_play
from worldpipe.rollout.http.schemas import (
    CandidatesIn,
    CandidatesOut,
    ExtendIn,
    Float32Array,
    ForkIn,
    RolloutIn,
    RolloutOut,
    SessionOpenIn,
    SessionOut,
)
from worldpipe.rollout.service import InputError, RolloutService
from worldpipe.rollout.sessions import SessionError

# Requests waiting on the batcher each hold a worker thread; the default 40 would cap the queue, not the model.
WORKER_THREADS = 512
# Where the app serves the Swagger UI and ReDoc assets it ships (package fastapi-offline).
DOCS_ASSETS = "/docs-assets"


def as_matrix(rows: list[list[float]], loc: tuple[str, ...]) -> torch.Tensor:
    """A float32 [n, k] tensor from JSON rows; no rows, or ragged ones, are an InputError at ``loc``."""
    if not rows:
        raise InputError(loc, "is empty: give at least one row")
    try:
        return torch.tensor(rows, dtype=torch.float32).reshape(len(rows), -1)
    except (ValueError, RuntimeError) as err:  # ragged rows
        raise InputError(loc, f"rows must all have the same length ({err})") from None


def from_float32(array: Float32Array, loc: tuple[str, ...]) -> torch.Tensor:
    """The float32 tensor a :class:`Float32Array` carries; undecodable bytes, a size that does not match its shape
    or a value that is not finite are an InputError at ``loc``."""
    try:
        raw = base64.b64decode(array.data, validate=True)
    except (binascii.Error, ValueError):
        raise InputError((*loc, "data"), "is not base64") from None
    expected = 4 * int(np.prod(array.shape))
    if len(raw) != expected:
        raise InputError((*loc, "data"), f"holds {len(raw)} bytes; shape {array.shape} needs {expected}")
    tensor = torch.from_numpy(np.frombuffer(raw, dtype="<f4").astype(np.float32)).reshape(array.shape)
    if not bool(torch.isfinite(tensor).all()):
        raise InputError((*loc, "data"), "contains NaN or infinity")
    return tensor


def to_float32(tensor: torch.Tensor) -> dict:
    """A tensor as a :class:`Float32Array`'s fields (little-endian float32 bytes, base64)."""
    values = tensor.detach().to(torch.float32).contiguous().numpy().astype("<f4", copy=False)
    return {"shape": list(values.shape), "data": base64.b64encode(values.tobytes()).decode("ascii")}


def jsonable(result: dict) -> dict:
    """The result with its tensors as nested lists."""
    for key in ("observations", "rewards", "frames"):
        if isinstance(result.get(key), torch.Tensor):
            result[key] = result[key].tolist()
    return result


class BodyLimit:
    """ASGI middleware: answer 413 when a request body exceeds ``limit`` bytes, before the app parses it."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self._reject(send)
        # Without a trustworthy length (chunked), read the body up to the limit first, then replay it.
        messages, seen = [], 0
        while True:
            message = await receive()
            messages.append(message)
            seen += len(message.get("body", b""))
            if seen > self.limit:
                return await self._reject(send)
            if message["type"] != "http.request" or not message.get("more_body"):
                break

        async def replay():
            return messages.pop(0) if messages else await receive()

        return await self.app(scope, replay, send)

    async def _reject(self, send):
        response = JSONResponse({"detail": f"request body over the limit of {self.limit} bytes"}, status_code=413)
        await response({"type": "http"}, None, send)


class ServerTiming:
    """ASGI middleware: a ``Server-Timing: app;dur=<ms>`` response header, the app's time from receiving a request
    to starting its answer (reading and parsing the body, queueing for a worker thread, the handler, serialising).

    A client subtracts it from its round trip to see the transport alone: the wire and HTTP framing, both ways.
    """

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = time.perf_counter()

        async def timed_send(message):
            if message["type"] == "http.response.start":
                elapsed_ms = (time.perf_counter() - started) * 1000
                headers = [*message.get("headers", []), (b"server-timing", f"app;dur={elapsed_ms:.3f}".encode())]
                message = {**message, "headers": headers}
            await send(message)

        return await self.app(scope, receive, timed_send)


def create_app(make_service: Callable[[], RolloutService]) -> FastAPI:
    """The app; ``make_service`` runs at startup and the service is closed (queue drained) at shutdown."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):

        anyio.to_thread.current_default_thread_limiter().total_tokens = WORKER_THREADS
        app.state.service = make_service()
        try:
            yield
        finally:
            app.state.service.close()

    # /docs and /redoc load their scripts, styles and icon from the app itself (DOCS_ASSETS), not from a CDN: the
    # service is often run where there is no internet.
    app = FastAPIOffline(title="worldpipe rollout service", lifespan=lifespan, static_url=DOCS_ASSETS,
                         description="Imagined trajectories from a trained world model (see docs/serving.md).")

    @app.exception_handler(RequestValidationError)
    async def _schema_error(request: Request, err: RequestValidationError):
        # Without the offending input: it may be NaN, which JSON cannot carry back.
        detail = [{"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]} for e in err.errors()]
        return JSONResponse({"detail": detail}, status_code=422)

    @app.exception_handler(InputError)
    async def _input_error(request: Request, err: InputError):
        return JSONResponse({"detail": [{"loc": ["body", *err.loc], "msg": err.message, "type": "value_error"}]},
                            status_code=422)

    @app.exception_handler(SessionError)
    async def _session_error(request: Request, err: SessionError):
        return JSONResponse({"detail": str(err)}, status_code=err.status)

    _routes(app)
    register_play(app)
    return app


def _routes(app: FastAPI) -> None:
    def service() -> RolloutService:
        return app.state.service

    @app.get("/health")
    def health() -> dict:
        latest = service().registry.latest()
        return {"status": "ok", "model_version": latest.version, "checkpoint_step": latest.step,
                "obs_dim": latest.obs_dim, "act_dim": latest.act_dim, "frame_shape": latest.frame_shape,
                "limits": service().config.limits.__dict__}

    @app.post("/reload")
    def reload() -> dict:
        """Serve the newest intact step of the run the server was started on (never another run)."""
        changed = service().reload()
        return {**health(), "changed": changed}

    @app.get("/stats")
    def stats() -> dict:
        return service().stats()

    @app.post("/rollout", response_model=RolloutOut)
    def rollout(body: RolloutIn) -> dict:
        t0 = time.perf_counter()
        inputs = (as_matrix(body.context.obs, ("context", "obs")), as_matrix(body.context.action, ("context", "action")),
                  as_matrix(body.actions, ("actions",)))
        t1 = time.perf_counter()
        result = service().rollout(*inputs, Sampling(body.sampling.mode, body.sampling.noise_scale),
                                   body.rng.seed, body.rng.stream, body.model_version)
        t2 = time.perf_counter()
        result = jsonable(result)
        t3 = time.perf_counter()
        # Named boundaries inside the handler (JSON parsing/validation before it and serialization after it
        # are part of what the client sees as transport). service_s holds queue_s + model_s + cache work.
        result["timing"].update(input_s=t1 - t0, service_s=t2 - t1, output_s=t3 - t2, handler_s=t3 - t0)
        return result

    @app.post("/imagine/candidates", response_model=CandidatesOut)
    def candidates(body: CandidatesIn) -> dict:
        """Score a planner's candidate action sequences from one context (rewards imagined with means)."""
        t0 = time.perf_counter()
        context = (as_matrix(body.context.obs, ("context", "obs")),
                   as_matrix(body.context.action, ("context", "action")))
        # JSON numbers or float32 bytes; the service checks either as [N, H, act_dim] (errors at "candidates").
        if body.candidates_f32 is not None:
            candidates = from_float32(body.candidates_f32, ("candidates_f32",))
        else:
            candidates = body.candidates
        result = service().imagine_candidates(*context, candidates, body.model_version)
        if body.candidates_f32 is not None:
            result["rewards_f32"] = to_float32(result.pop("rewards"))
        else:
            result["rewards"] = result["rewards"].tolist()
        result["timing"]["handler_s"] = time.perf_counter() - t0
        return result

    @app.post("/sessions", response_model=SessionOut)
    def open_session(body: SessionOpenIn) -> dict:
        return service().open_session(
            as_matrix(body.context.obs, ("context", "obs")), as_matrix(body.context.action, ("context", "action")),
            Sampling(body.sampling.mode, body.sampling.noise_scale), body.rng.seed, body.rng.stream,
            body.model_version)

    @app.post("/sessions/{session_id}/extend", response_model=SessionOut)
    def extend(session_id: str, body: ExtendIn, x_session_token: str | None = Header(None)) -> dict:
        return jsonable(service().extend(session_id, x_session_token, as_matrix(body.actions, ("actions",))))

    @app.post("/sessions/{session_id}/fork", response_model=SessionOut)
    def fork(session_id: str, body: ForkIn, x_session_token: str | None = Header(None)) -> dict:
        return service().fork(session_id, x_session_token, body.step)

    @app.delete("/sessions/{session_id}")
    def close(session_id: str, x_session_token: str | None = Header(None)) -> dict:
        return service().close_session(session_id, x_session_token)
