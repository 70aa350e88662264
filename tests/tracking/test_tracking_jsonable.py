"""Readable JSON of RNG and sampler states reads back to the same objects."""

import json
import random

import numpy as np
import torch

from worldpipe.tracking.jsonable import from_jsonable, to_jsonable


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def test_rng_state_round_trips_through_json_text():
    gen = torch.Generator().manual_seed(3)
    state = {
        "python": random.Random(1).getstate(),
        "numpy_global": np.random.RandomState(2).get_state(),
        "numpy": {"aug": np.random.default_rng(5).bit_generator.state},
        "torch": torch.get_rng_state(),
        "generators": {"latent_noise": gen.get_state()},
        "floats": torch.arange(4, dtype=torch.float64).reshape(2, 2),
        "raw": b"\x00\xff",
        "empty": torch.empty(0),
    }
    text = json.dumps(to_jsonable(state))
    back = from_jsonable(json.loads(text))
    assert _equal(state, back)
    restored = torch.Generator()
    restored.set_state(back["generators"]["latent_noise"])
    assert torch.equal(torch.randn(3, generator=restored), torch.randn(3, generator=gen))


def test_sampler_state_stays_plain():
    sampler = {"seed": 0, "epoch": 1, "cursor": 96, "window": 16}
    assert to_jsonable(sampler) == sampler
