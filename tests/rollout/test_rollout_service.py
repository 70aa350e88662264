"""Every cache and session rule of the rollout service, against a real `worldpipe serve` over HTTP."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import requests

from serve_support import ServerProcess
from worldpipe.rollout.demo import publish_demo_checkpoint

pytestmark = pytest.mark.integration


def request(seed: int = 0, horizon: int = 6, context: int = 4, stream: str | None = "s", **extra) -> dict:
    """A rollout request with inputs drawn from ``seed`` (obs_dim 3, act_dim 1, like the demo model)."""
    rng = np.random.default_rng(seed)
    body = {"context": {"obs": rng.normal(size=(context, 3)).tolist(), "action": rng.normal(size=(context, 1)).tolist()},
            "actions": rng.uniform(-1, 1, size=(horizon, 1)).tolist(), "rng": {"seed": 7}}
    if stream is not None:
        body["rng"]["stream"] = stream
    body.update(extra)
    return body


def rollout(server: ServerProcess, body: dict) -> dict:
    response = server.post("/rollout", body)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("served") / "checkpoints"
    publish_demo_checkpoint(root, step=1, seed=0)
    return root


@pytest.fixture(scope="module")
def server(checkpoints, tmp_path_factory, env_with_venv):
    proc = ServerProcess(checkpoints, tmp_path_factory.mktemp("server"), env_with_venv, "--max-batch", "8")
    yield proc
    assert proc.stop() == 0


def test_health_and_openapi_docs(server):
    health = server.get("/health").json()
    assert health["status"] == "ok" and health["obs_dim"] == 3 and health["act_dim"] == 1
    assert "/rollout" in server.get("/openapi.json").json()["paths"]
    assert server.get("/docs").status_code == 200


def test_fresh_sample_is_never_a_cached_draw(server):
    body = request(seed=1, stream="named")
    first, again = rollout(server, body), rollout(server, body)
    assert not first["cache_hit"] and again["cache_hit"]
    assert again["observations"] == first["observations"]
    fresh = [rollout(server, request(seed=1, stream=None)) for _ in range(3)]
    streams = {f["stream"]["stream"] for f in fresh}
    assert len(streams) == 3 and "named" not in streams
    for f in fresh:
        assert not f["cache_hit"] and f["cached_steps"] == 0
        assert f["observations"] != first["observations"]
    assert fresh[0]["observations"] != fresh[1]["observations"]
    # a fresh stream, once named, is an ordinary reproducible stream
    replay = rollout(server, {**request(seed=1), "rng": fresh[0]["stream"]})
    assert replay["observations"] == fresh[0]["observations"]


@pytest.mark.slow
def test_shared_prefix_reuses_cached_state_and_equals_full_computation(server, checkpoints, tmp_path,
                                                                       env_with_venv):
    full = request(seed=2, horizon=10, stream="prefix")
    prefix = {**full, "actions": full["actions"][:6]}
    short = rollout(server, prefix)
    extended = rollout(server, full)
    assert extended["cached_steps"] == 6 and not extended["cache_hit"]
    assert extended["observations"][:6] == short["observations"]
    # the same draw computed from scratch on another server process (no cache, other batches)
    other = ServerProcess(checkpoints, tmp_path / "other", env_with_venv, "--max-batch", "1")
    try:
        scratch = rollout(other, full)
    finally:
        assert other.stop() == 0
    assert scratch["cached_steps"] == 0
    assert scratch["observations"] == extended["observations"] and scratch["rewards"] == extended["rewards"]


@pytest.mark.slow
def test_batch_composition_does_not_change_a_result(checkpoints, tmp_path, env_with_venv):
    bodies = [request(seed=10 + i, horizon=3 + i, context=2 + i % 3, stream=f"b{i}") for i in range(8)]
    bodies[3] = {**bodies[3], "sampling": {"mode": "mean"}}
    alone = ServerProcess(checkpoints, tmp_path / "alone", env_with_venv, "--max-batch", "1")
    try:
        singles = [rollout(alone, b) for b in bodies]
    finally:
        assert alone.stop() == 0
    assert all(s["timing"]["batch"] == 1 for s in singles)
    # batches close only when full (8 requests), so all eight are computed together
    batched = ServerProcess(checkpoints, tmp_path / "batched", env_with_venv, "--max-batch", "8",
                            "--max-wait-ms", "600000")
    try:
        with ThreadPoolExecutor(8) as pool:
            together = list(pool.map(lambda b: rollout(batched, b), bodies))
    finally:
        assert batched.stop() == 0
    assert all(t["timing"]["batch"] == 8 for t in together)
    for single, joint in zip(singles, together, strict=True):
        assert joint["observations"] == single["observations"] and joint["rewards"] == single["rewards"]


@pytest.mark.slow
def test_new_checkpoint_never_hits_entries_of_the_old_one(tmp_path, env_with_venv):
    root = tmp_path / "checkpoints"
    publish_demo_checkpoint(root, step=1, seed=0)
    server = ServerProcess(root, tmp_path / "srv", env_with_venv, "--poll-s", "0.1")
    try:
        body = request(seed=3)
        old = rollout(server, body)
        assert rollout(server, body)["cache_hit"]
        publish_demo_checkpoint(root, step=2, seed=1)
        deadline = time.monotonic() + 120
        while server.get("/health").json()["model_version"] == old["model_version"]:
            assert time.monotonic() < deadline, "new checkpoint not picked up"
            time.sleep(0.1)
        new = rollout(server, body)
        assert new["model_version"] != old["model_version"] and new["checkpoint_step"] == 2
        assert not new["cache_hit"] and new["cached_steps"] == 0
        assert new["observations"] != old["observations"]
        # the old version has no sessions left, so it is no longer served: a 4xx naming the field
        pinned = server.post("/rollout", {**body, "model_version": old["model_version"]})
        assert pinned.status_code == 422 and pinned.json()["detail"][0]["loc"] == ["body", "model_version"]
    finally:
        assert server.stop() == 0


def open_session(server, seed=4, stream="sess", **extra) -> dict:
    body = request(seed=seed, stream=stream)
    body.pop("actions")
    body.update(extra)
    response = server.post("/sessions", body)
    assert response.status_code == 200, response.text
    return response.json()


def extend(server, session, actions) -> dict:
    response = server.post(f"/sessions/{session['session_id']}/extend", {"actions": actions}, session["token"])
    assert response.status_code == 200, response.text
    return response.json()


def test_session_extensions_equal_one_rollout(server):
    actions = request(seed=4, horizon=7)["actions"]
    session = open_session(server)
    first, second = extend(server, session, actions[:3]), extend(server, session, actions[3:])
    assert second["step"] == 7
    whole = rollout(server, request(seed=4, horizon=7, stream="sess"))
    assert first["observations"] + second["observations"] == whole["observations"]


def test_fork_does_not_disturb_its_parent(server):
    actions = request(seed=5, horizon=8)["actions"]
    parent, witness = open_session(server, stream="f"), open_session(server, stream="f")
    extend(server, parent, actions[:4])
    extend(server, witness, actions[:4])
    child = server.post(f"/sessions/{parent['session_id']}/fork", {"step": 2}, parent["token"]).json()
    assert child["step"] == 2 and child["parent"] == parent["session_id"]
    other = [[-a[0]] for a in actions[2:]]
    child_out = extend(server, child, other)
    parent_out = extend(server, parent, actions[4:])
    assert parent_out == {**extend(server, witness, actions[4:]), "session_id": parent["session_id"],
                          "timing": parent_out["timing"]}
    # the child is the parent at step 2 plus its own actions: equal to a fresh session taking that path
    fresh = open_session(server, stream="f")
    assert extend(server, fresh, actions[:2] + other)["observations"][2:] == child_out["observations"]


def test_closed_or_unknown_session_answers_a_clear_error(server):
    session = open_session(server, stream="c")
    wrong = server.post(f"/sessions/{session['session_id']}/extend", {"actions": [[0.0]]}, "not-the-token")
    assert wrong.status_code == 403
    assert server.delete(f"/sessions/{session['session_id']}", session["token"]).status_code == 200
    gone = server.post(f"/sessions/{session['session_id']}/extend", {"actions": [[0.0]]}, session["token"])
    assert gone.status_code == 410 and "closed" in gone.json()["detail"]
    assert server.post("/sessions/nope/extend", {"actions": [[0.0]]}, "t").status_code == 404


@pytest.mark.slow
def test_eviction_under_memory_budget(server, checkpoints, tmp_path, env_with_venv):
    # What one demo session holds (80 bytes of state tensors, a few KiB with overheads): a budget of 2.5 holds two.
    held = open_session(server, stream="size")["held_bytes"]
    budget = 2.5 * held
    small = ServerProcess(checkpoints, tmp_path / "budget", env_with_venv, "--session-budget-mb",
                          str(budget / 2**20))
    try:
        sessions = [open_session(small, seed=i, stream=f"e{i}") for i in range(3)]
        evicted = small.post(f"/sessions/{sessions[0]['session_id']}/extend", {"actions": [[0.0]]},
                              sessions[0]["token"])
        assert evicted.status_code == 410 and "evicted" in evicted.json()["detail"]
        stats = small.get("/stats").json()
        assert stats["sessions"]["live"] == 2 and stats["sessions"]["released"]["evicted"] == 1
        assert stats["memory"]["session_held"] <= budget
        extend(small, sessions[2], [[0.0]])  # the survivors are intact
    finally:
        assert small.stop() == 0


@pytest.mark.slow
def test_idle_session_expires(checkpoints, tmp_path, env_with_venv):
    server = ServerProcess(checkpoints, tmp_path / "idle", env_with_venv, "--session-idle-s", "0.5",
                           "--poll-s", "0.05")
    try:
        session = open_session(server, stream="idle")
        time.sleep(1.0)  # longer than the idle timeout: the outcome does not depend on how much longer
        expired = server.post(f"/sessions/{session['session_id']}/extend", {"actions": [[0.0]]}, session["token"])
        assert expired.status_code == 410 and "expired" in expired.json()["detail"]
        stats = server.get("/stats").json()
        assert stats["sessions"]["live"] == 0 and stats["memory"]["session_state"] == 0
    finally:
        assert server.stop() == 0


def wait_for(path: Path, proc: ServerProcess) -> None:
    deadline = time.monotonic() + 120
    while not path.exists():
        assert proc.proc.poll() is None and time.monotonic() < deadline, proc.log.read_text()[-2000:]
        time.sleep(0.01)


def held_server(checkpoints, folder: Path, env) -> ServerProcess:
    folder.mkdir()
    return ServerProcess(checkpoints, folder, {**env, "WORLDPIPE_SERVE_HOLD": str(folder)})


@pytest.mark.slow
def test_session_closed_mid_request_leaks_no_memory(checkpoints, tmp_path, env_with_venv):
    hold = tmp_path / "hold"
    server = held_server(checkpoints, hold, env_with_venv)
    try:
        session = open_session(server, stream="k")
        before = server.get("/stats").json()
        assert before["sessions"]["live"] == 1 and before["memory"]["session_state"] > 0
        (hold / "hold").touch()
        result = {}
        worker = threading.Thread(target=lambda: result.update(r=server.post(
            f"/sessions/{session['session_id']}/extend", {"actions": [[0.5]] * 20}, session["token"])))
        worker.start()
        wait_for(hold / "held", server)  # the extension is inside the model now
        assert server.delete(f"/sessions/{session['session_id']}", session["token"]).status_code == 200
        (hold / "hold").unlink()
        worker.join(timeout=120)
        assert result["r"].status_code == 410 and "while the request was running" in result["r"].json()["detail"]
        after = server.get("/stats").json()
        assert after["sessions"]["live"] == 0
        assert after["memory"]["session_state"] == 0 and after["memory"]["session_history"] == 0
        # the state tensors the session and its dropped extension held are gone (cache empty: no rollouts)
        assert after["cache"]["entries"] == 0
        assert after["rollout_state_tensors_alive"] == 0
    finally:
        assert server.stop() == 0


@pytest.mark.slow
def test_sigterm_drains_in_flight_requests(checkpoints, tmp_path, env_with_venv):
    hold = tmp_path / "hold"
    server = held_server(checkpoints, hold, env_with_venv)
    (hold / "hold").touch()
    result = {}
    worker = threading.Thread(target=lambda: result.update(r=server.post("/rollout", request(seed=9, horizon=30))))
    worker.start()
    try:
        wait_for(hold / "held", server)
        server.terminate()
        (hold / "hold").unlink()
        worker.join(timeout=120)
        assert result["r"].status_code == 200
        assert len(result["r"].json()["observations"]) == 30
        assert server.proc.wait(timeout=120) == 0
    finally:
        server.stop()


@pytest.mark.parametrize("mutate, status, loc", [
    (lambda b: b["context"].update(obs=[[0.0, 0.0]] * 4), 422, ["body", "context", "obs"]),
    (lambda b: b["context"]["obs"][1].__setitem__(2, float("nan")), 422, ["body", "context", "obs", 1, 2]),
    (lambda b: b.update(actions=[[0.0]] * 257), 422, ["body", "actions"]),
    (lambda b: b.update(actions=[[0.0], [0.0, 1.0]]), 422, ["body", "actions"]),
    (lambda b: b.update(model_version="f" * 64), 422, ["body", "model_version"]),
    (lambda b: b.update(sampling={"mode": "argmax"}), 422, ["body", "sampling", "mode"]),
    (lambda b: b.update(unexpected=1), 422, ["body", "unexpected"]),
])
def test_bad_input_is_a_4xx_naming_the_field(server, mutate, status, loc):
    body = request(seed=6)
    mutate(body)
    # json.dumps writes NaN as the bare token NaN, which is what a careless client sends
    response = requests.post(server.url + "/rollout", data=json.dumps(body), timeout=60,
                             headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    assert response.json()["detail"][0]["loc"] == loc


def test_request_over_the_size_limit_is_413(server):
    body = request(seed=6, horizon=200, context=200)
    body["padding"] = "x" * (1 << 20)
    assert server.post("/rollout", body).status_code == 413


def _candidates_body(candidates: list, context: int = 4) -> dict:
    body = request(seed=8, context=context)
    return {"context": body["context"], "candidates": candidates}


@pytest.mark.parametrize("candidates, obs, loc, needles", [
    ([[[0.1]] * 5, [[0.2]] * 5, [[0.3, 0.4]] + [[0.3]] * 4], None, ["body", "candidates", 2],
     ["candidate 2 step 0 has 2 values", "acts with 1"]),
    ([[[0.1]] * 5, [[0.2]] * 4], None, ["body", "candidates", 1], ["candidate 1 has 4 steps, candidate 0 has 5"]),
    ([[[0.1]] * 5, []], None, ["body", "candidates", 1], ["candidate 1 is empty"]),
    ([], None, ["body", "candidates"], ["has 0 candidates"]),
    ([[[0.1]] * 5], [], ["body", "context", "obs"], ["is empty"]),
])
def test_bad_candidates_are_a_422_naming_the_candidate_and_the_width(server, candidates, obs, loc, needles):
    body = _candidates_body(candidates)
    if obs is not None:
        body["context"]["obs"] = obs
    response = server.post("/imagine/candidates", body)
    assert response.status_code == 422, response.text
    detail = response.json()["detail"][0]
    assert detail["loc"] == loc and all(needle in detail["msg"] for needle in needles), detail
    assert "reshape" not in detail["msg"] and "tensor" not in detail["msg"]


def test_good_candidates_are_scored(server):
    response = server.post("/imagine/candidates", _candidates_body([[[0.1]] * 5, [[-0.2]] * 5]))
    assert response.status_code == 200, response.text
    assert np.asarray(response.json()["rewards"]).shape == (2, 5)
