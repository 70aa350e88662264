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


def test_recompute_keeps_the_gradients_bit_for_bit_and_saves_less_for_backward():
    """parallel.recompute: each block keeps only its input for backward; the recomputed forward is the same
    arithmetic, so the gradients are identical, and fewer bytes are saved during the forward."""
    from worldpipe.parallel.memory import saved_activations

    spec = {"_target_": "worldpipe.models.transformer.CausalTransformer", "width": 16, "heads": 2, "layers": 2}
    gen = torch.Generator().manual_seed(0)
    obs, action, reward = torch.randn(4, 12, 3, generator=gen), torch.randn(4, 12, 1, generator=gen), torch.randn(4, 12, generator=gen)
    mask = torch.ones(4, 12)
    grads, saved = {}, {}
    for recompute in (False, True):
        torch.manual_seed(0)
        layout = build_layout({"strategy": "none", "recompute": recompute}, RUNTIME)
        model = layout.wrap(build_model(spec, 3, 1))
        with saved_activations(model) as held:
            sums = layout.forward_backward(model, {"obs": obs, "action": action, "reward": reward, "mask": mask,
                                                   "noise": None}, 48, model.loss_terms)
        saved[recompute] = sum(held.values())
        grads[recompute] = {n: p.grad.clone() for n, p in model.named_parameters()}
        assert sums["total"] > 0 and layout.describe.get("recompute", False) == recompute
    assert all(torch.equal(grads[True][n], grads[False][n]) for n in grads[False])
    assert saved[True] < 0.6 * saved[False], saved
