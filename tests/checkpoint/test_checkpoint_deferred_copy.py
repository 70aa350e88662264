"""Async saves whose parameter/optimizer copy overlaps the next forward and backward.

The copy of what ``optimizer.step()`` writes runs on a thread and is awaited by a step pre-hook; everything
else is copied before ``save`` returns. The published checkpoint must equal the state at the save call.
"""

import pytest
import torch

from checkpoint_states import example_state
from worldpipe.checkpoint import CheckpointManager, async_writer, state_digest
from worldpipe.checkpoint.async_writer import deferred_copy, step_mutated


def _trained(width: int = 64):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.BatchNorm1d(width), torch.nn.Linear(width, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _step(model, opt)
    return model, opt


def _step(model, opt) -> None:
    model(torch.randn(8, model[0].in_features)).square().mean().backward()  # BatchNorm stats change here
    opt.step()
    opt.zero_grad()


def _state(model, opt) -> dict:
    state = example_state()
    state["model"], state["optimizer"], state["scheduler"] = model.state_dict(), opt.state_dict(), None
    return state


def test_step_mutated_selects_parameters_and_optimizer_state_only():
    model, opt = _trained()
    mutated = step_mutated(opt, min_bytes=0)
    state = _state(model, opt)
    assert mutated(state["model"]["0.weight"]) and mutated(state["optimizer"]["state"][0]["exp_avg"])
    assert not mutated(state["model"]["1.running_mean"])  # a buffer: forward changes it
    assert not mutated(state["model"]["0.weight"].clone())


def test_a_small_optimizer_state_is_not_deferred():
    """Below the threshold the training thread copies everything itself (None: no predicate, no copy thread)."""
    model, opt = _trained()
    written = sum(p.untyped_storage().nbytes() for p in model.parameters())
    written += sum(v.untyped_storage().nbytes() for s in opt.state.values() for v in s.values()
                   if isinstance(v, torch.Tensor))
    assert written < async_writer.DEFER_MIN_BYTES
    assert step_mutated(opt) is None
    assert step_mutated(opt, min_bytes=written + 1) is None
    assert step_mutated(opt, min_bytes=written) is not None


@pytest.mark.parametrize("deferred", [True, False], ids=["deferred copy", "copied at once"])
def test_published_checkpoint_is_the_state_at_save_time(tmp_path, monkeypatch, deferred):
    if deferred:
        monkeypatch.setattr(async_writer, "DEFER_MIN_BYTES", 0)
    model, opt = _trained()
    state = _state(model, opt)
    expected = state_digest(state)
    running_mean = state["model"]["1.running_mean"].clone()
    with CheckpointManager(tmp_path / "ck", async_save=True) as cm:
        cm.save(1, state, optimizer=opt)
        assert (cm.writer._copy is not None) == deferred
        for _ in range(3):  # forward changes the buffers at once; the pre-hook holds the optimizer back
            _step(model, opt)
        cm.wait()
        loaded = cm.load(1)
        assert state_digest(loaded) == expected
        assert torch.equal(loaded["model"]["1.running_mean"], running_mean)
        # A second save reuses the first one's buffers; it too publishes the state of its own moment.
        state2 = _state(model, opt)
        expected2 = state_digest(state2)
        cm.save(2, state2, optimizer=opt)
        cm.writer.before_optimizer_step()
        _step(model, opt)
    assert state_digest(CheckpointManager(tmp_path / "ck").load(2)) == expected2


def test_copy_failure_is_raised_where_the_copy_is_awaited():
    copy = deferred_copy([(torch.empty(3), torch.empty(4))])
    try:
        copy.result()
    except RuntimeError as exc:
        assert "size" in str(exc) or "shape" in str(exc) or "expand" in str(exc)
    else:
        raise AssertionError("a failing copy must raise in result()")
