"""A layout on one process: no wrapper, no mesh, loss normalized by the global valid count alone."""

import pytest
import torch

from worldpipe.models import build_model
from worldpipe.parallel.layout import build_layout
from worldpipe.parallel.runtime import Runtime

RUNTIME = Runtime(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


@pytest.mark.parametrize("strategy", ["none", "ddp", "fsdp2"])
def test_one_process_trains_the_plain_model(strategy):
    layout = build_layout({"strategy": strategy, "tensor_parallel": 1, "context_parallel": 1}, RUNTIME)
    model = build_model({"_target_": "worldpipe.models.ssm.LinearSSM", "width": 8, "state": 4, "layers": 1}, 3, 1)
    assert layout.wrap(model) is model
    assert (layout.dp_rank, layout.dp_size, layout.metric_weight) == (0, 1, 1.0)
    assert layout.loss_scale(40) == pytest.approx(1 / 40)
    batch = {"obs": torch.zeros(2, 6, 3), "mask": torch.ones(2, 6), "sample_index": torch.arange(2)}
    assert layout.shard_batch(batch) is batch
    assert layout.replicated_parameters == (strategy != "fsdp2")
