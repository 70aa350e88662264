"""A served frame model answers with imagined frames: uint8 [H, 3, height, width] beside the flat observations."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from worldpipe.rollout.demo import publish_demo_checkpoint
from worldpipe.rollout.engine import Sampling
from worldpipe.rollout.http.app import jsonable
from worldpipe.rollout.http.schemas import RolloutOut, SessionOut
from worldpipe.rollout.service import RolloutService

pytestmark = pytest.mark.integration

SIZE = 16
PIXEL_MODEL = {"_target_": "worldpipe.models.pixel_rssm.PixelRSSM", "image_size": SIZE, "depth": 4, "embed": 16,
               "deter": 16, "stoch": 4, "classes": 5, "hidden": 16}


@pytest.fixture
def one_thread():
    """One intra-op thread: on a shared 2-core machine, more threads only fight over the cores (seconds here)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_session_steps_and_rollouts_of_a_frame_model_carry_uint8_frames(tmp_path, one_thread):
    publish_demo_checkpoint(tmp_path / "ckpt", model_cfg=PIXEL_MODEL, obs_dim=SIZE * SIZE * 3)
    service = RolloutService(str(tmp_path / "ckpt"))
    try:
        assert service.registry.latest().frame_shape == (SIZE, SIZE, 3)
        rng = np.random.default_rng(0)
        context = torch.from_numpy(rng.integers(0, 256, (3, SIZE * SIZE * 3)).astype(np.float32))
        actions = torch.zeros(3, 1)
        opened = service.open_session(context, actions, Sampling("sample"), seed=1, stream="s")
        step = jsonable(service.extend(opened["session_id"], opened["token"], torch.ones(2, 1)))
        doc = SessionOut.model_validate(step).model_dump()
        frames = np.asarray(doc["frames"])
        assert frames.shape == (2, 3, SIZE, SIZE) and frames.min() >= 0 and frames.max() <= 255
        expected = np.clip(np.rint(np.asarray(doc["observations"])), 0, 255).reshape(2, SIZE, SIZE, 3).transpose(0, 3, 1, 2)
        assert np.array_equal(frames, expected)  # the same imagination, drawn as a picture
        whole = jsonable(service.rollout(context, actions, torch.ones(2, 1), Sampling("sample"), 1, "s"))
        assert RolloutOut.model_validate(whole).frames == doc["frames"]  # a session step equals the rollout
    finally:
        service.close()
