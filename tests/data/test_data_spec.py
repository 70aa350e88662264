"""DatasetSpec validation: every error names the offending key."""

import json

import pytest

from worldpipe.data.spec import DatasetSpec

BASE = {
    "name": "pend-small",
    "env_id": "Pendulum-v1",
    "policy": "random",
    "episodes": 10,
    "max_steps": 20,
    "episodes_per_shard": 4,
    "seed": 7,
}


def test_round_trip_and_defaults():
    spec = DatasetSpec.from_dict(BASE)
    assert spec.pixels is False and spec.pixel_size == 32 and spec.compressor == "zstd"
    d = spec.to_dict()
    assert json.loads(json.dumps(d)) == d
    assert DatasetSpec.from_dict(d) == spec


@pytest.mark.parametrize(("episodes", "per_shard", "shards"), [(10, 4, 3), (8, 4, 2), (1, 5, 1), (5, 1, 5)])
def test_num_shards(episodes, per_shard, shards):
    spec = DatasetSpec.from_dict({**BASE, "episodes": episodes, "episodes_per_shard": per_shard})
    assert spec.num_shards == shards
    ranges = [spec.shard_range(s) for s in range(shards)]
    assert ranges[0][0] == 0 and ranges[-1][1] == episodes
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))


def test_unknown_key_is_named():
    with pytest.raises(ValueError, match="episodez"):
        DatasetSpec.from_dict({**BASE, "episodez": 3})


def test_missing_key_is_named():
    d = dict(BASE)
    del d["max_steps"]
    with pytest.raises(ValueError, match="max_steps"):
        DatasetSpec.from_dict(d)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("episodes", 0),
        ("episodes", -3),
        ("max_steps", 0),
        ("episodes_per_shard", 0),
        ("episodes", 2.5),
        ("episodes", True),
        ("seed", -1),
        ("env_id", "MountainCar-v0"),
        ("policy", "expert"),
        ("compressor", "lz4"),
        ("pixel_size", 4),
        ("pixels", "yes"),
        ("name", "has space"),
    ],
)
def test_bad_value_names_key(key, value):
    with pytest.raises(ValueError, match=key):
        DatasetSpec.from_dict({**BASE, key: value})


def test_shard_range_bounds():
    spec = DatasetSpec.from_dict(BASE)
    with pytest.raises(ValueError, match="shard index"):
        spec.shard_range(spec.num_shards)
