"""Issue 19, case 13: what the session budget counts is what sessions really hold, measured against the resident
set of a real `worldpipe serve` process over a few thousand `POST /sessions`; a budget then holds about as many
sessions as its bytes of real memory allow, and the process grows by about the budget, not far past it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import requests

from serve_support import ServerProcess
from worldpipe.rollout.demo import publish_demo_checkpoint

pytestmark = [pytest.mark.integration, pytest.mark.slow]

WARM_UP, SESSIONS = 300, 2000


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("served") / "checkpoints"
    publish_demo_checkpoint(root, step=1, seed=0)
    return root


def _open_many(server: ServerProcess, count: int, offset: int = 0) -> None:
    rng = np.random.default_rng(offset)
    with requests.Session() as http:  # one keep-alive connection: the growth measured is the sessions'
        for i in range(offset, offset + count):
            body = {"context": {"obs": rng.normal(size=(4, 3)).tolist(), "action": rng.normal(size=(4, 1)).tolist()},
                    "rng": {"seed": 7, "stream": f"m{i}"}}
            response = http.post(server.url + "/sessions", json=body, timeout=60)
            assert response.status_code == 200, response.text


def _memory(server: ServerProcess) -> dict:
    stats = server.get("/stats").json()
    return {**stats["memory"], "live": stats["sessions"]["live"], "evicted": stats["sessions"]["released"]["evicted"]}


def test_session_bytes_track_resident_memory_and_the_budget_evicts_accordingly(checkpoints, tmp_path,
                                                                                 env_with_venv):
    server = ServerProcess(checkpoints, tmp_path / "unbounded", env_with_venv, "--max-batch", "1")
    try:
        _open_many(server, WARM_UP)  # threads, allocator arenas, lazy imports: not the sessions' cost
        before = _memory(server)
        _open_many(server, SESSIONS, WARM_UP)
        after = _memory(server)
    finally:
        assert server.stop() == 0
    rss_each = (after["process_rss"] - before["process_rss"]) / SESSIONS
    held_each = (after["session_held"] - before["session_held"]) / SESSIONS
    print(f"per session: resident set +{rss_each:.0f} B, counted {held_each:.0f} B "
          f"(state tensors {(after['session_state'] - before['session_state']) / SESSIONS:.0f} B)")
    assert after["live"] == WARM_UP + SESSIONS
    assert 0.75 <= held_each / rss_each <= 1.33

    # A budget of 800 sessions' real bytes: the server holds about 800 and grows by about the budget. It is sent
    # twice as many sessions as above: without eviction it would grow by 5 budgets; the allocator's own noise
    # (a few MiB, about one budget here) stays well inside the 2 budgets allowed.
    budget = 800 * rss_each
    bounded = ServerProcess(checkpoints, tmp_path / "bounded", env_with_venv, "--max-batch", "1",
                            "--session-budget-mb", str(budget / 2**20))
    try:
        _open_many(bounded, WARM_UP)
        start = _memory(bounded)
        _open_many(bounded, 2 * SESSIONS, WARM_UP)
        end = _memory(bounded)
    finally:
        assert bounded.stop() == 0
    print(f"budget {budget / 2**20:.2f} MiB: {end['live']} live, {end['evicted']} evicted, resident set "
          f"+{(end['process_rss'] - start['process_rss']) / 2**20:.2f} MiB")
    assert 600 <= end["live"] <= 1000 and end["evicted"] == WARM_UP + 2 * SESSIONS - end["live"]
    assert end["session_held"] <= budget
    assert end["process_rss"] - start["process_rss"] <= 2 * budget
