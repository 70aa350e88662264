"""The planner's candidates scored by the rollout service equal the same scores in-process, bit for bit.

The closed loop compares its planner's actions in-process and over HTTP (`http_takes_the_in_process_actions`).
The server scores candidates on its web worker threads; the intra-op thread count is per OS thread, so a worker
thread left at its default ran MKL on every core, split small matrix products differently from the evaluation's
one thread, and changed their last bits (a context window of 5 to 7 steps on a 2-core machine). Real service,
real threads, a real RSSM checkpoint.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from serve_support import ServerProcess
from worldpipe.control.dynamics import LearnedDynamics, ServedDynamics
from worldpipe.rollout.demo import publish_demo_checkpoint
from worldpipe.rollout.http.app import from_float32, to_float32
from worldpipe.rollout.http.schemas import Float32Array
from worldpipe.rollout.service import RolloutService

pytestmark = pytest.mark.integration

# Wide enough that MKL would split the products over threads: the bug needs a thread count above one to show.
MODEL = {"_target_": "worldpipe.models.rssm.RSSM", "embed": 16, "deter": 32, "stoch": 4, "hidden": 32}


@pytest.fixture
def one_thread():
    """The evaluation's setting: one intra-op thread in the thread that computes."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _on_new_thread(function):
    out = {}
    worker = threading.Thread(target=lambda: out.update(value=function()))
    worker.start()
    worker.join()
    return out["value"]


def test_candidates_scored_on_a_server_worker_thread_equal_the_in_process_scores(tmp_path, one_thread):
    publish_demo_checkpoint(tmp_path / "ckpt", model_cfg=MODEL, obs_dim=3, act_dim=1)
    service = RolloutService(str(tmp_path / "ckpt"))
    model = service.registry.latest().model
    generator = torch.Generator().manual_seed(0)
    differing = []
    try:
        for window in range(1, 13):
            obs = torch.randn(window, 3, generator=generator)
            taken = torch.randn(window - 1, 1, generator=generator)
            candidates = torch.randn(64, 6, 1, generator=generator)
            dynamics = LearnedDynamics(model, context=16)  # in-process, on this thread
            dynamics.observe(obs, taken)
            expected = dynamics.imagine(candidates)
            context_action = torch.cat([taken, taken.new_zeros(1, 1)])  # the row a served window carries
            served = _on_new_thread(lambda o=obs, a=context_action, c=candidates:  # as uvicorn's worker does
                                    service.imagine_candidates(o, a, c)["rewards"])
            if not torch.equal(served, expected):
                differing.append((window, float((served - expected).abs().max())))
    finally:
        service.close()
    assert differing == [], f"windows whose served scores differ (window, max abs difference): {differing}"
    assert service.threads == 1


def test_a_served_round_trip_splits_into_the_wire_and_the_apps_own_time(tmp_path, env_with_venv, one_thread):
    publish_demo_checkpoint(tmp_path / "ckpt", model_cfg=MODEL, obs_dim=3, act_dim=1)
    server = ServerProcess(tmp_path / "ckpt", tmp_path / "srv", env_with_venv, "--threads", "1")
    try:
        dynamics = ServedDynamics(server.url, context=4, act_dim=1)
        dynamics.observe(torch.zeros(4, 3), torch.zeros(3, 1))
        started = time.perf_counter()
        rewards = dynamics.imagine(torch.zeros(32, 5, 1))
        round_trip = time.perf_counter() - started
        timing = dynamics.take_timing()
        context = {"obs": [[0.1, -0.2, 0.3]] * 4, "action": [[0.5]] * 4}
        candidates = torch.randn(32, 5, 1, generator=torch.Generator().manual_seed(1))
        answer = server.post("/imagine/candidates", {"context": context, "candidates": candidates.tolist()})
        packed = server.post("/imagine/candidates", {"context": context, "candidates_f32": to_float32(candidates)})
        refusals = {
            "both": server.post("/imagine/candidates", {"context": context, "candidates": candidates.tolist(),
                                                        "candidates_f32": to_float32(candidates)}),
            "not base64": server.post("/imagine/candidates", {"context": context, "candidates_f32": {
                "shape": [32, 5, 1], "data": "not base64!"}}),
            "short": server.post("/imagine/candidates", {"context": context, "candidates_f32": {
                **to_float32(candidates), "shape": [33, 5, 1]}}),
            "nan": server.post("/imagine/candidates", {"context": context, "candidates_f32": to_float32(
                torch.full((2, 5, 1), float("nan")))}),
        }
    finally:
        assert server.stop() == 0
    # The same numbers as JSON text or as float32 bytes: the same rewards, bit for bit.
    as_json = torch.tensor(answer.json()["rewards"], dtype=torch.float32)
    as_bytes = from_float32(Float32Array(**packed.json()["rewards_f32"]), ("rewards_f32",))
    assert packed.json()["rewards"] is None and torch.equal(as_json, as_bytes)
    assert all(r.status_code == 422 for r in refusals.values()), {k: r.text for k, r in refusals.items()}
    assert "give the candidates once" in refusals["both"].text
    assert refusals["not base64"].json()["detail"][0]["loc"] == ["body", "candidates_f32", "data"]
    assert "shape [33, 5, 1] needs 660" in refusals["short"].text and "NaN" in refusals["nan"].text
    assert rewards.shape == (32, 5)
    header = answer.headers["server-timing"]
    app_ms = float(header.split("dur=")[1])
    assert header.startswith("app;dur=") and app_ms * 1000 >= answer.json()["timing"]["handler_s"] * 1e6 > 0
    # Transport is the round trip less the app's time; the app's time beyond the model is output.
    assert 0 < timing["transport"] < round_trip and timing["output"] > 0 and timing["model"] > 0
    assert abs(sum(timing.values()) - round_trip) < round_trip * 0.5
