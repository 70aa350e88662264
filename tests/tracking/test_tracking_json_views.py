"""Readable JSON of RNG and sampler states holds them exactly: every tensor's bytes, every array's values."""

import json
import random

import numpy as np
import torch

from worldpipe.tracking.records import to_jsonable


def test_rng_state_is_held_exactly_in_json_text():
    gen = torch.Generator().manual_seed(3)
    state = {
        "python": random.Random(1).getstate(),
        "numpy_global": np.random.RandomState(2).get_state(),
        "numpy": {"aug": np.random.default_rng(5).bit_generator.state},  # 128-bit ints
        "torch": torch.get_rng_state(),
        "generators": {"latent_noise": gen.get_state()},
        "floats": torch.arange(4, dtype=torch.float64).reshape(2, 2),
        "raw": b"\x00\xff",
        "empty": torch.empty(0),
    }
    view = json.loads(json.dumps(to_jsonable(state)))
    version, words, gauss = state["python"]
    assert view["python"] == {"__tuple__": [version, {"__tuple__": list(words)}, gauss]}
    name, keys, pos, has_gauss, cached = state["numpy_global"]
    assert view["numpy_global"] == {"__tuple__": [name, {"__ndarray__": keys.dtype.str, "shape": [624],
                                                         "data": keys.tolist()}, pos, has_gauss, cached]}
    assert view["numpy"] == state["numpy"]
    noise = view["generators"]["latent_noise"]
    assert noise["__tensor__"] == "uint8" and bytes.fromhex(noise["hex"]) == bytes(gen.get_state().numpy())
    assert view["floats"] == {"__tensor__": "float64", "shape": [2, 2],
                              "hex": state["floats"].numpy().tobytes().hex()}
    assert view["raw"] == {"__bytes__": "00ff"} and view["empty"] == {"__tensor__": "float32", "shape": [0], "hex": ""}
    restored = torch.Generator()  # the view is the state: a generator set from its bytes draws the same numbers
    restored.set_state(torch.frombuffer(bytearray.fromhex(noise["hex"]), dtype=torch.uint8))
    assert torch.equal(torch.randn(3, generator=restored), torch.randn(3, generator=gen))


def test_sampler_state_stays_plain():
    sampler = {"seed": 0, "epoch": 1, "cursor": 96, "window": 16}
    assert to_jsonable(sampler) == sampler
