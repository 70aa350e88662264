"""State snapshots, RNG capture/restore and state validation."""

import random

import numpy as np
import pytest
import torch

from checkpoint_states import example_state
from worldpipe.checkpoint import CheckpointManager, capture_rng, restore_rng, snapshot_state
from worldpipe.checkpoint.state import validate_state


def _draws(torch_gens):
    return (
        [random.random() for _ in range(3)],
        np.random.random(3).tolist(),
        torch.rand(3).tolist(),
        {n: torch.rand(3, generator=g).tolist() for n, g in torch_gens.items()},
    )


def _generators():
    return {"latent": torch.Generator().manual_seed(3), "dropout": torch.Generator().manual_seed(4)}


def test_capture_restore_in_process():
    torch_gens = _generators()
    _draws(torch_gens)  # advance away from the seeds
    rng = capture_rng(torch_gens)
    expected = _draws(torch_gens)
    _draws(torch_gens)
    restore_rng(rng, torch_gens)
    assert _draws(torch_gens) == expected


def test_rng_survives_save_and_load(tmp_path):
    torch_gens = _generators()
    random.gauss(0, 1)  # leaves a cached gaussian in Python's state
    state = example_state()
    state["rng"] = [capture_rng(torch_gens)]
    expected = _draws(torch_gens)
    CheckpointManager(tmp_path / "ck").save(1, state)
    _draws(torch_gens)
    fresh_torch = {"latent": torch.Generator(), "dropout": torch.Generator()}
    loaded = CheckpointManager(tmp_path / "ck").load()
    restore_rng(loaded["rng"][0], fresh_torch)
    assert _draws(fresh_torch) == expected


def test_each_rank_restores_its_own_rng(tmp_path):
    state = example_state(ranks=3)
    CheckpointManager(tmp_path / "ck").save(1, state)
    loaded = CheckpointManager(tmp_path / "ck").load()
    assert len(loaded["rng"]) == 3
    for rank in range(3):
        g = torch.Generator()
        restore_rng(loaded["rng"][rank], {"latent": g})
        ref = torch.Generator()
        ref.set_state(state["rng"][rank]["generators"]["latent"])
        assert torch.equal(torch.rand(4, generator=g), torch.rand(4, generator=ref))
    assert (tmp_path / "ck" / "step-000001" / "rng" / "rank-00002.json").exists()


def test_restore_refuses_unknown_generator():
    rng = capture_rng({})
    with pytest.raises(KeyError, match="latent"):
        restore_rng(rng, {"latent": torch.Generator()})


def test_snapshot_is_independent_and_keeps_ties():
    w = torch.nn.Parameter(torch.randn(4, 4))
    state = {"model": {"a": w, "b": w.detach()}, "optimizer": {"state": {0: {"m": torch.zeros(2)}}},
             "progress": {"step": 1}, "sampler": {"cursor": [1, 2]}}
    snap = snapshot_state(state)
    assert snap["model"]["a"] is snap["model"]["b"]  # tied weights stay tied
    assert not snap["model"]["a"].requires_grad
    with torch.no_grad():
        w.add_(1.0)
    state["optimizer"]["state"][0]["m"].add_(1.0)
    state["sampler"]["cursor"].append(3)
    assert not torch.equal(snap["model"]["a"], w.detach())
    assert torch.equal(snap["optimizer"]["state"][0]["m"], torch.zeros(2))
    assert snap["sampler"]["cursor"] == [1, 2]


def test_snapshot_reuses_buffers():
    state = {"model": {"w": torch.randn(8)}}
    record: dict = {}
    first = snapshot_state(state, record=record)
    state["model"]["w"].add_(1)
    second = snapshot_state(state, reuse=record, record={})
    assert second["model"]["w"].data_ptr() == first["model"]["w"].data_ptr()
    assert torch.equal(second["model"]["w"], state["model"]["w"])


@pytest.mark.parametrize("bad, match", [
    ({"model": {}, "extra": 1}, "unknown state keys"),
    ({"model": None}, "model"),
    ({"model": {}, "progress": {"step": 1.5}}, "progress"),
    ({"model": {}, "sampler": {"x": object()}}, "JSON"),
    ({"model": {}, "identity": {"x": float("nan")}}, "JSON"),
    ({"model": {}, "rng": {"python": 1}}, "rng"),
])
def test_validate_state_rejects(bad, match):
    with pytest.raises(ValueError, match=match):
        validate_state(bad)
