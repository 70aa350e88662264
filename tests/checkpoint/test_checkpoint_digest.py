"""state_digest: content identity, independent of file layout, rank count and RNG."""

import torch

from checkpoint_states import example_state
from worldpipe.checkpoint import CheckpointManager, checkpoint_digest, state_digest


def test_same_state_same_digest_across_saves(tmp_path):
    state = example_state(seed=1)
    a, b = CheckpointManager(tmp_path / "a"), CheckpointManager(tmp_path / "b", async_save=True)
    a.save(5, state)
    b.save(5, state)
    b.close()
    assert checkpoint_digest(tmp_path / "a") == checkpoint_digest(tmp_path / "b") == state_digest(state)


def test_digest_ignores_rng_and_identity_and_rank_count(tmp_path):
    one, two = example_state(seed=1, ranks=1), example_state(seed=1, ranks=2)
    two["identity"]["world_size"] = 2
    assert state_digest(one) == state_digest(two)
    CheckpointManager(tmp_path / "one").save(3, one)
    CheckpointManager(tmp_path / "two").save(3, two)
    assert checkpoint_digest(tmp_path / "one", 3) == checkpoint_digest(tmp_path / "two", 3)


def test_one_flipped_bit_changes_digest():
    state = example_state(seed=1)
    before = state_digest(state)
    weight = state["model"]["0.weight"]
    weight.view(torch.int32)[0, 0] ^= 1  # lowest mantissa bit of one parameter
    assert state_digest(state) != before


def test_digest_sees_every_part():
    base = example_state(seed=2, ema=True, scaler=True)
    reference = state_digest(base)
    changes = [
        lambda s: s["optimizer"]["param_groups"][0].__setitem__("lr", 2e-3),
        lambda s: s["optimizer"]["state"][0]["exp_avg"].add_(1),
        lambda s: s["scheduler"].__setitem__("last_epoch", 7),
        lambda s: s["scaler"].__setitem__("scale", 1.0),
        lambda s: s["ema"]["0.bias"].add_(1),
        lambda s: s["progress"].__setitem__("tokens_seen", 1),
        lambda s: s["sampler"].__setitem__("cursor", 1),
        lambda s: s["model"].__setitem__("0.bias", s["model"]["0.bias"].double()),  # dtype counts
        lambda s: s["model"].__setitem__("0.bias", s["model"]["0.bias"].reshape(1, -1)),  # shape counts
    ]
    for change in changes:
        state = example_state(seed=2, ema=True, scaler=True)
        change(state)
        assert state_digest(state) != reference


def test_digest_ignores_layout_details():
    state = example_state(seed=3)
    w = state["model"]["0.weight"]
    variant = example_state(seed=3)
    variant["model"]["0.weight"] = w.t().contiguous().t()  # same values, different strides
    variant["model"] = dict(reversed(list(variant["model"].items())))  # different key order
    variant["optimizer"]["param_groups"][0]["betas"] = list(variant["optimizer"]["param_groups"][0]["betas"])
    assert state_digest(variant) == state_digest(state)
