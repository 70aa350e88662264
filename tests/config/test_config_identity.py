"""The run's identity is the whole config except what a resume may change: checked leaf by leaf.

For every experiment, every leaf of the composed config is changed in turn and the config hash recomputed:
a leaf outside the resume-safe set below must change the hash (a run with another value is another run and
must never resume into this one's directory), a leaf inside it must not. The set is written down here, on its
own, rather than read from ``worldpipe.config.identity``: adding a key there (say ``model.hidden``) must fail
this test, not move it.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from worldpipe.config.identity import config_hash, flatten, to_container
from worldpipe.config.paths import CONF_DIR
from worldpipe.launch.launcher import compose_config

EXPERIMENTS = sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))

# What a resume may change without changing what was computed for the steps already taken.
RESUME_SAFE_LEAVES = {
    "trainer.steps",  # train longer (or stop sooner)
    "trainer.log_every", "trainer.progress_bar", "trainer.threads_per_rank",  # reporting, CPU threads
    "checkpoint.every", "checkpoint.keep_last", "checkpoint.keep_every", "checkpoint.async_save",
    "checkpoint.verify", "checkpoint.allow_config_change", "checkpoint.dir",  # how state is saved and checked
    "data.store", "data.manifest",  # where the (hash-checked) dataset lies
    "data.cache_mb", "data.prefetch",  # how it is read
    "run_dir",
}
# Whole groups: the parallel layout (every layout computes the same global-mean gradient), where results are
# recorded and where files live.
RESUME_SAFE_GROUPS = ("parallel.", "tracking.", "paths.")


def expected_safe(key: str) -> bool:
    return key in RESUME_SAFE_LEAVES or key.startswith(RESUME_SAFE_GROUPS)


def changed(value: Any) -> Any:
    """Another value of the same kind (what an override would plausibly set)."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value * 2 + 1
    if isinstance(value, str):
        return value + "-other"
    if isinstance(value, list):
        return [*value, value[-1] if value else 1]
    if isinstance(value, dict):
        return {**value, "other": 1}
    return "other"  # None


def with_leaf(tree: dict, key: str, value: Any) -> dict:
    out = copy.deepcopy(tree)
    node = out
    *parents, last = key.split(".")
    for part in parents:
        node = node[part]
    node[last] = value
    return out


@pytest.fixture(scope="module")
def composed() -> dict[str, dict]:
    return {name: to_container(compose_config([f"experiment={name}"])) for name in EXPERIMENTS}


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_leaf_outside_the_resume_safe_set_changes_the_hash(composed, experiment):
    tree = composed[experiment]
    base = config_hash(tree)
    leaves = flatten(tree)
    assert len(leaves) > 40, sorted(leaves)  # the whole config, not a stub
    unsafe_but_ignored = [k for k in leaves if not expected_safe(k) and config_hash(with_leaf(tree, k, changed(leaves[k]))) == base]
    safe_but_hashed = [k for k in leaves if expected_safe(k) and config_hash(with_leaf(tree, k, changed(leaves[k]))) != base]
    assert unsafe_but_ignored == [], "keys a resume would let change, though they change what is computed"
    assert safe_but_hashed == [], "keys that change the run's identity, though a resume may change them"


def test_the_resume_safe_set_names_only_real_keys(composed):
    present = set().union(*(flatten(tree) for tree in composed.values()))
    assert RESUME_SAFE_LEAVES - present == set()
    for group in RESUME_SAFE_GROUPS:
        assert any(k.startswith(group) for k in present), group
