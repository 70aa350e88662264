"""The play page (GET /play) in real headless Chromium against a real `worldpipe serve` on 127.0.0.1.

The page plays a scripted key sequence from its URL (``keys=RRFLL``: → → fork ← ←) through its own keyboard
handler, then Chromium dumps the DOM: each branch records its actions, the canvas digest after every draw and
its newest imagined observation, which must equal what POST /rollout imagines for the same context, actions
and stream. A screenshot is kept at results/ui/play.png.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from serve_support import ServerProcess
from worldpipe.data.build import build_dataset
from worldpipe.data.spec import DatasetSpec
from worldpipe.rollout.demo import publish_demo_checkpoint

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--no-first-run", "--disable-sync", "--hide-scrollbars"]
SCREENSHOT = Path("results") / "ui" / "play.png"  # under the repository root
PIXEL_SCREENSHOT = SCREENSHOT.with_name("play-pixels.png")
LENGTH, CONTEXT = 8, 3
PIXEL_CONTEXT = 1  # the second of the two held-out windows of rendered frames
FRAME = 16  # a tiny frame model keeps the pixel page in seconds: the layers of conf/model/pixel_rssm.yaml
TINY_PIXEL_RSSM = {"_target_": "worldpipe.models.pixel_rssm.PixelRSSM", "image_size": FRAME, "depth": 2,
                   "embed": 8, "deter": 8, "stoch": 4, "classes": 4, "hidden": 8}


class PageDom(HTMLParser):
    """The body's attributes, the status line and every branch section's data attributes."""

    def __init__(self, html: str) -> None:
        super().__init__()
        self.body: dict = {}
        self.branches: list[dict] = []
        self.status, self._in_status = "", False
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "body":
            self.body = attrs
        elif tag == "section" and "branch" in (attrs.get("class") or ""):
            self.branches.append(attrs)
        self._in_status = attrs.get("id") == "status"

    def handle_data(self, data):
        if self._in_status:
            self.status += data

    def handle_endtag(self, tag):
        self._in_status = False


def chromium(url: str, profile: Path, *args: str) -> subprocess.CompletedProcess:
    """One headless Chromium run; virtual time waits while the page's requests are in flight."""
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if binary is None:
        pytest.skip("chromium is not installed (.ci/system-deps.sh installs it)")
    cmd = [binary, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--window-size=1100,560",
           "--virtual-time-budget=60000", *args, url]
    return subprocess.run(cmd, capture_output=True, timeout=120)


def page(server: ServerProcess, tmp_path: Path, query: str) -> PageDom:
    proc = chromium(f"{server.url}/play?{query}", Path(tempfile.mkdtemp(dir=tmp_path)), "--dump-dom")
    dom = PageDom(proc.stdout.decode(errors="replace"))
    assert dom.body.get("data-done") == "1", (proc.stdout.decode()[-2000:], proc.stderr.decode()[-2000:])
    return dom


@pytest.fixture(scope="module")
def server(tmp_path_factory, smoke_dataset, env_with_venv):
    checkpoints = tmp_path_factory.mktemp("served") / "checkpoints"
    publish_demo_checkpoint(checkpoints, step=1, seed=0)  # obs_dim 3, act_dim 1: Pendulum's sizes
    store, manifest = smoke_dataset
    proc = ServerProcess(checkpoints, tmp_path_factory.mktemp("server"), env_with_venv,
                         "--heldout-store", str(store), "--heldout-manifest", str(manifest))
    yield proc
    assert proc.stop() == 0


@pytest.fixture(scope="module")
def pixel_server(tmp_path_factory, env_with_venv):
    """A frame model (fresh weights) served with a held-out set of rendered Pendulum frames at its size."""
    root = tmp_path_factory.mktemp("pixels-served")
    publish_demo_checkpoint(root / "checkpoints", step=1, seed=0, model_cfg=TINY_PIXEL_RSSM,
                            obs_dim=FRAME * FRAME * 3)
    spec = DatasetSpec(name="pixels-heldout", env_id="Pendulum-v1", policy="noisy_controller", episodes=2,
                       max_steps=LENGTH + 4, episodes_per_shard=2, seed=1000, pixels=True, pixel_size=FRAME)
    store, manifest = str(root / "store.zarr"), str(root / "manifest.json")
    build_dataset(store, spec, manifest)
    proc = ServerProcess(root / "checkpoints", tmp_path_factory.mktemp("pixel-server"), env_with_venv,
                         "--heldout-store", store, "--heldout-manifest", manifest)
    yield proc
    assert proc.stop() == 0


def screenshot(server: ServerProcess, query: str, out: Path, profile: Path) -> np.ndarray:
    """Chromium's PNG of the page after playing ``query``'s keys, as RGB pixels."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.unlink(missing_ok=True)
    shot = chromium(f"{server.url}/play?{query}", profile, f"--screenshot={out}")
    assert shot.returncode == 0 and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return np.asarray(Image.open(out).convert("RGB"))


def imagined(server: ServerProcess, actions: list[list[float]], context: int = CONTEXT) -> list[float]:
    """The last observation POST /rollout imagines from the page's context with the page's stream."""
    window = server.get(f"/contexts?length={LENGTH}&start={context}&count=1").json()["contexts"][0]
    body = {"context": {"obs": window["obs"], "action": window["action"]}, "actions": actions,
            "rng": {"seed": 0, "stream": f"play-{context}"}}
    response = server.post("/rollout", body)
    assert response.status_code == 200, response.text
    return response.json()["observations"][-1]


def test_steps_draw_and_a_fork_shows_two_branches(server, tmp_path, repo):
    dom = page(server, tmp_path, f"context={CONTEXT}&length={LENGTH}&keys=RRFLL")
    assert "data-error" not in dom.body and dom.status.startswith("played RRFLL"), dom.status
    a, b = dom.branches
    assert (a["data-name"], b["data-name"]) == ("A", "B") and "active" in b["class"]
    assert json.loads(a["data-actions"]) == [[1], [1]]
    assert json.loads(b["data-actions"]) == [[1], [1], [-1], [-1]]
    assert a["data-session"] != b["data-session"]
    # every step drew a new picture: the canvas digest after the start and after each step all differ
    for branch, draws in ((a, 3), (b, 3)):
        digests = branch["data-digests"].split(",")
        assert len(digests) == draws and len(set(digests)) == draws, digests
        assert branch["data-kind"] == "state"  # a state model: no frames in its responses, so a plot
    # what the page shows is the model's imagination: equal to a stateless rollout of the same path
    assert json.loads(a["data-last-obs"]) == imagined(server, [[1], [1]])
    assert json.loads(b["data-last-obs"]) == imagined(server, [[1], [1], [-1], [-1]])
    assert a["data-last-obs"] != b["data-last-obs"]
    # side by side on a shared scale, the two branches' pictures differ where their imagined paths do
    assert a["data-digests"].split(",")[-1] != b["data-digests"].split(",")[-1]

    out = repo / SCREENSHOT
    pixels = screenshot(server, f"context={CONTEXT}&length={LENGTH}&keys=RRRRFLLLLLL", out, tmp_path / "shot")
    assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 50  # two plotted branches, not a blank page
    print(f"play page screenshot: {out}")


def test_a_frame_model_draws_each_imagined_frame_and_forks(pixel_server, tmp_path, repo):
    dom = page(pixel_server, tmp_path, f"context={PIXEL_CONTEXT}&length={LENGTH}&keys=RRFLL")
    assert "data-error" not in dom.body and dom.status.startswith("played RRFLL"), dom.status
    a, b = dom.branches
    assert json.loads(b["data-actions"]) == [[1], [1], [-1], [-1]] and a["data-session"] != b["data-session"]
    for branch in (a, b):
        assert branch["data-kind"] == "frame"  # the responses carry frames: the page paints the newest
        digests = branch["data-digests"].split(",")
        assert len(digests) == 3 and len(set(digests)) == 3, digests  # each step painted a new frame
    # the painted frame is the model's: its newest imagined observation is a stateless rollout's
    assert json.loads(a["data-last-obs"]) == imagined(pixel_server, [[1], [1]], PIXEL_CONTEXT)
    assert json.loads(b["data-last-obs"]) == imagined(pixel_server, [[1], [1], [-1], [-1]], PIXEL_CONTEXT)
    assert a["data-digests"].split(",")[-1] != b["data-digests"].split(",")[-1]  # two branches, two frames

    out = repo / PIXEL_SCREENSHOT
    pixels = screenshot(pixel_server, f"context={PIXEL_CONTEXT}&length={LENGTH}&keys=RRFLL", out, tmp_path / "shot")
    assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 50  # two painted frames, not a blank page
    print(f"play page screenshot (frame model): {out}")


def test_bad_input_is_one_error_line(server, tmp_path):
    dom = page(server, tmp_path, f"length={LENGTH}&keys=RX")
    assert dom.body["data-error"] == "keys: unknown key 'X' at position 1 (use L R U D N F B)"
    assert dom.status == dom.body["data-error"]
    dom = page(server, tmp_path, "length=500")
    assert dom.body["data-error"].startswith("GET /contexts: HTTP 422: query.length: ")
    assert "\n" not in dom.body["data-error"] and dom.branches == []
    for query, field in (("length=0", "length"), ("count=999", "count"), ("model=nope", "model"),
                         ("typo=1", "typo")):
        response = server.get(f"/contexts?{query}")
        assert response.status_code == 422 and [d["loc"] for d in response.json()["detail"]] == [["query", field]]
