"""The play page: pick a served model, start a session from a held-out context, step it with the keyboard.

``GET /play`` is a static page (HTML, plain JS, CSS shipped in ``static/``; nothing is fetched from anywhere but
this server). It drives the session endpoints the app already has (``POST /sessions``, ``/extend``, ``/fork``)
and two read-only ones added here: ``GET /models`` (the versions this server holds) and ``GET /contexts``
(held-out windows, :mod:`worldpipe.rollout.contexts`).

Frame contract with pixel models: a step's response may carry ``frames`` ([H, 3, 64, 64] uint8, channels
first); the page draws the newest one on the branch's canvas. Without frames it plots the imagined state.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from fastapi import FastAPI, Query
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse

from worldpipe.rollout.http.schemas import ContextsQuery
from worldpipe.rollout.registry import UnknownModelVersion

STATIC_DIR = Path(__file__).parent / "static"
# The only files the page is made of; anything else under /play/static is a 404 (no directory walking).
STATIC_FILES = {"play.js": "text/javascript", "play.css": "text/css"}


def register_play(app: FastAPI) -> None:
    """Add the play page and its two read-only endpoints to ``app``.

    ``app.state.heldout`` (a :class:`~worldpipe.rollout.contexts.HeldoutContexts`, or None) is set by whoever
    builds the app (``worldpipe serve --heldout-store/--heldout-manifest``).
    """

    @app.get("/play", response_class=HTMLResponse, include_in_schema=False)
    def play_page() -> HTMLResponse:
        return HTMLResponse((STATIC_DIR / "play.html").read_text(encoding="utf-8"))

    @app.get("/play/static/{name}", include_in_schema=False)
    def play_static(name: str):
        if name not in STATIC_FILES:
            return JSONResponse({"detail": f"/play/static/{name}: no such file"}, status_code=404)
        return FileResponse(STATIC_DIR / name, media_type=STATIC_FILES[name])

    @app.get("/models")
    def models() -> dict:
        """The model versions this server holds (the newest first); ``latest`` is what requests get by default."""
        registry = app.state.service.registry
        latest = registry.latest().version
        held = sorted(registry.loaded(), key=lambda m: m.step, reverse=True)
        return {"latest": latest, "models": [{"version": m.version, "step": m.step, "obs_dim": m.obs_dim,
                                              "act_dim": m.act_dim} for m in held]}

    @app.get("/contexts")
    def contexts(query: Annotated[ContextsQuery, Query()]) -> dict:
        """Held-out windows of ``length`` steps to open a session with (the segments evaluation cuts)."""
        heldout = getattr(app.state, "heldout", None)
        if heldout is None:
            return JSONResponse({"detail": "no held-out data: start `worldpipe serve` with --heldout-store and "
                                           "--heldout-manifest (the held-out dataset evaluation reads)"},
                                status_code=404)
        service = app.state.service
        try:
            served = service.registry.get(query.model)
        except UnknownModelVersion as err:
            return _query_error("model", str(err))
        if query.length > service.config.limits.max_context:
            return _query_error("length", f"{query.length} is over the server's --max-context "
                                          f"{service.config.limits.max_context}")
        try:
            result = heldout.windows(query.length, query.start, query.count)
        except ValueError as err:  # no held-out episode is that long
            return _query_error("length", str(err))
        return {"model_version": served.version, **result}


def _query_error(field: str, message: str) -> JSONResponse:
    """A 422 shaped like the app's validation errors, naming the query parameter at fault."""
    return JSONResponse({"detail": [{"loc": ["query", field], "msg": message, "type": "value_error"}]},
                        status_code=422)
