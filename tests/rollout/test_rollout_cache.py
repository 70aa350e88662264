"""Result cache: complete keys, longest cached prefix, LRU bounds; measurement helpers."""

from __future__ import annotations

import torch

from worldpipe.measure.memory import LiveTensorPeak
from worldpipe.measure.timers import Timeline
from worldpipe.rollout.cache import CachedDraw, DrawKey, ResultCache, prefix_hashes


def draw(k: int) -> CachedDraw:
    return CachedDraw(torch.zeros(k, 3), torch.zeros(k), {"h": torch.zeros(1, 4)})


def test_longest_prefix_and_complete_key():
    cache = ResultCache()
    actions = torch.arange(6.0).reshape(6, 1)
    hashes = prefix_hashes(actions)
    key = DrawKey("v1", "ctx", "cfg", "0:s")
    cache.put(key, hashes[2], draw(2))
    cache.put(key, hashes[4], draw(4))
    k, entry = cache.longest_prefix(key, hashes)
    assert k == 4 and entry.obs.shape[0] == 4
    for other in (DrawKey("v2", "ctx", "cfg", "0:s"), DrawKey("v1", "ctx2", "cfg", "0:s"),
                  DrawKey("v1", "ctx", "cfg2", "0:s"), DrawKey("v1", "ctx", "cfg", "0:t")):
        assert cache.longest_prefix(other, hashes) is None
    changed = actions.clone()
    changed[1] = 9.0
    assert cache.longest_prefix(key, prefix_hashes(changed)) is None  # h_k chains over every earlier action


def test_lru_bounds_entries_and_bytes():
    cache = ResultCache(max_entries=2, max_bytes=10_000)
    hashes = prefix_hashes(torch.zeros(3, 1))
    keys = [DrawKey("v", f"c{i}", "cfg", "s") for i in range(3)]
    cache.put(keys[0], hashes[1], draw(1))
    cache.put(keys[1], hashes[1], draw(1))
    assert cache.longest_prefix(keys[0], hashes[:2]) is not None  # touch 0: 1 is now the oldest
    cache.put(keys[2], hashes[1], draw(1))
    assert cache.longest_prefix(keys[1], hashes[:2]) is None
    assert cache.stats()["entries"] == 2
    small = ResultCache(max_bytes=100)
    small.put(keys[0], hashes[1], draw(10))  # larger than the whole budget: not stored
    assert small.stats()["entries"] == 0


def test_critical_path_charges_each_instant_once():
    line = Timeline()
    line.add("prepare", 0.0, 2.0)
    line.add("model", 1.0, 4.0)
    line.add("output", 5.0, 6.0)
    assert line.critical_path() == {"prepare": 1.0, "model": 3.0, "idle": 1.0, "output": 1.0}
    assert line.totals() == {"prepare": 2.0, "model": 3.0, "output": 1.0}


def test_live_tensor_peak_sees_temporaries():
    x = torch.randn(64, 64)
    with LiveTensorPeak() as peak:
        y = (x @ x).relu().sum()
    assert peak.peak >= 64 * 64 * 4 and y.numel() == 1
