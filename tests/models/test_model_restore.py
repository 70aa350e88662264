"""models.restore: recorded dims win; a checkpoint written before dims were recorded still rebuilds."""

from __future__ import annotations

import pytest
import torch

from worldpipe.config.compose import compose_config
from worldpipe.models import build_model
from worldpipe.models.restore import DIMS_KEY, model_dims, model_dims_record, restore_model


@pytest.mark.parametrize("model_name", ["rssm", "gru", "transformer", "ssm"])
def test_dims_are_inferred_from_weights_when_not_recorded(model_name):
    cfg = dict(compose_config([f"model={model_name}"]).model)
    weights = build_model(cfg, 5, 3).state_dict()
    assert model_dims({}, weights, cfg) == (5, 3)
    assert model_dims({DIMS_KEY: model_dims_record(5, 3)}, weights, cfg) == (5, 3)


def test_restored_model_equals_the_saved_one_and_wrong_dims_are_refused():
    cfg = dict(compose_config(["model=rssm"]).model)
    torch.manual_seed(0)
    saved = build_model(cfg, 4, 2)
    weights = saved.state_dict()
    restored = restore_model(cfg, weights, {DIMS_KEY: model_dims_record(4, 2)})
    assert not restored.training
    assert all(torch.equal(restored.state_dict()[k], v) for k, v in weights.items())
    with pytest.raises(RuntimeError, match="size mismatch"):
        restore_model(cfg, weights, {DIMS_KEY: model_dims_record(4, 3)})
