"""worldpipe.rollout.http: the HTTP rollout service (FastAPI app, uvicorn server)."""
