"""worldpipe.serve: the HTTP rollout service (FastAPI app, uvicorn server)."""
