"""The play page's pieces that need no browser: held-out windows, refusals of `serve --heldout-*`, shipped files.

The page itself is driven in headless Chromium by tests/rollout/test_play_page.py (slow tier).
"""

from __future__ import annotations

import re
import tomllib
from fnmatch import fnmatch

import numpy as np
import pytest

from worldpipe import cli
from worldpipe.core.errors import UsageError
from worldpipe.evaluate.open_loop import heldout_segments
from worldpipe.rollout.contexts import HeldoutContexts
from worldpipe.rollout.http.play import STATIC_DIR, STATIC_FILES


def episodes(lengths=(10, 5, 17), max_steps=20) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    n = len(lengths)
    return {"obs": rng.normal(size=(n, max_steps, 3)).astype(np.float32),
            "action": rng.normal(size=(n, max_steps, 1)).astype(np.float32),
            "length": np.asarray(lengths, dtype=np.int32)}


def test_windows_are_the_segments_evaluation_scores():
    data = episodes()
    contexts = HeldoutContexts("hash", data)
    obs, action = heldout_segments(data, 4)
    listed = contexts.windows(4, start=1, count=3)
    assert listed["total"] == obs.shape[0] == 2 + 1 + 4
    assert [c["index"] for c in listed["contexts"]] == [1, 2, 3]
    assert np.array_equal(np.asarray([c["obs"] for c in listed["contexts"]], dtype=np.float32), obs[1:4])
    assert np.array_equal(np.asarray([c["action"] for c in listed["contexts"]], dtype=np.float32), action[1:4])
    assert [c["index"] for c in contexts.windows(4, start=6, count=5)["contexts"]] == [6]  # clipped at the end


def test_a_window_longer_than_every_episode_names_the_longest():
    with pytest.raises(ValueError, match="no held-out window of 18 steps: the longest held-out episode has 17"):
        HeldoutContexts("hash", episodes()).windows(18, 0, 1)


def test_dims_that_cannot_feed_the_model_are_refused():
    with pytest.raises(UsageError, match="obs_dim 3, act_dim 1; the model has obs_dim 4, act_dim 1"):
        HeldoutContexts("hash", episodes()).check_dims(4, 1, "the model")


@pytest.mark.parametrize("args, named", [
    (["--heldout-store", "s.zarr"], "--heldout-store and --heldout-manifest go together"),
    (["--heldout-store", "s.zarr", "--heldout-manifest", "{tmp}/missing.json"], "--heldout-manifest {tmp}/missing.json: "),
    (["--heldout-store", "s.zarr", "--heldout-manifest", "{tmp}/garbage.json"], "--heldout-manifest {tmp}/garbage.json: "),
])
def test_serve_refuses_a_bad_heldout_dataset_in_one_line_before_loading(args, named, tmp_path, capsys):
    (tmp_path / "garbage.json").write_text("{not json")
    args = [a.format(tmp=tmp_path) for a in args]
    # the checkpoint directory does not exist either: the held-out data is refused first, before any model loads
    rc = cli.main(["serve", str(tmp_path / "no-checkpoints"), "--port", "0", *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: " + named.format(tmp=tmp_path)), err


def test_the_page_ships_in_the_package_and_fetches_nothing_from_outside():
    globs = tomllib.loads((STATIC_DIR.parents[4] / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"]["worldpipe.rollout.http"]
    shipped = sorted(p.name for p in STATIC_DIR.iterdir())
    assert shipped == sorted(["play.html", *STATIC_FILES])
    assert all(any(fnmatch(f"static/{name}", g) for g in globs) for name in shipped)
    html = (STATIC_DIR / "play.html").read_text()
    assert sorted(re.findall(r'(?:src|href)="/play/static/([^"]+)"', html)) == sorted(STATIC_FILES)
    for name in shipped:
        assert not re.search(r"(?:https?:)?//[a-z0-9.-]+\.[a-z]{2,}", (STATIC_DIR / name).read_text()), name


def test_a_frame_model_gets_flat_frames_and_a_store_without_them_is_refused():
    data = episodes()
    data["pixels"] = np.random.default_rng(1).integers(0, 256, size=(3, 20, 2, 2, 3), dtype=np.uint8)
    contexts = HeldoutContexts("hash", data)
    contexts.windows(4, 0, 1)  # cut from "obs" first: observed_by must drop those windows
    contexts.observed_by("pixels")
    assert contexts.obs_dim == 12
    frames, _ = heldout_segments(data, 4, "pixels")
    listed = contexts.windows(4, start=0, count=2)
    assert np.array_equal(np.asarray([c["obs"] for c in listed["contexts"]], dtype=np.float32), frames[:2])
    with pytest.raises(UsageError, match="--heldout-store: it stores no 'pixels' array"):
        HeldoutContexts("hash", episodes()).observed_by("pixels")
