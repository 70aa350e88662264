"""The rollout service's /docs and /redoc load with no internet: every asset they reference is the app's own."""

import asyncio
import re
from urllib.parse import urlparse

import pytest

from worldpipe.rollout.http.app import create_app


class Response:
    def __init__(self, status_code: int, content: bytes):
        self.status_code, self.content = status_code, content
        self.text = content.decode("utf-8", "replace")


class Client:
    """GET requests straight into the ASGI app, in this process (starlette's TestClient needs httpx2)."""

    def __init__(self, app):
        self.app = app

    def get(self, path: str) -> Response:
        return asyncio.run(self._get(path))

    async def _get(self, path: str) -> Response:
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET",
                 "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"",
                 "headers": [(b"host", b"testserver")], "server": ("testserver", 80), "client": ("test", 1)}
        status, body, requested = [], bytearray(), []

        async def receive():
            if requested:  # the body was sent: later calls wait for a disconnect, which never comes
                await asyncio.Event().wait()
            requested.append(True)
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message):
            if message["type"] == "http.response.start":
                status.append(message["status"])
            elif message["type"] == "http.response.body":
                body.extend(message.get("body", b""))

        await self.app(scope, receive, send)
        return Response(status[0], bytes(body))


@pytest.fixture(scope="module")
def client():
    # No lifespan events are sent, so the model service is never built: the docs need no model.
    return Client(create_app(lambda: None))


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
def test_docs_pages_reference_only_same_origin_assets_that_the_app_serves(client, page):
    response = client.get(page)
    assert response.status_code == 200
    html = response.text
    # Every src=/href= and every quoted URL (Swagger's openapi url is in a script literal).
    urls = set(re.findall(r"""(?:src|href)\s*=\s*["']([^"']+)["']""", html))
    urls |= set(re.findall(r"""["'](https?://[^"']+|//[^"']+)["']""", html))
    assets = {u for u in urls if u.endswith((".js", ".css", ".png", ".ico", ".svg"))}
    assert assets, f"{page} references no scripts or styles: {sorted(urls)}"
    foreign = sorted(u for u in urls if urlparse(u).netloc)
    assert not foreign, f"{page} loads from other hosts: {foreign}"
    for asset in assets:
        fetched = client.get(asset)
        assert fetched.status_code == 200, f"{page} references {asset}: {fetched.status_code}"
        assert len(fetched.content) > 1000, asset
