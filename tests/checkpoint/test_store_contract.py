"""The checkpoint store contract: what every store behind :class:`CheckpointManager` must do, run against each.

One class of cases (:class:`StoreContract`), one subclass per store: a POSIX directory, fsspec's ``memory://``
and S3 (a local moto server through s3fs). Each subclass says only how to reach its store's bytes and what a
half-written step looks like there (POSIX: a ``.partial`` directory the rename never published; object stores:
the step's files without ``MANIFEST.json``, the commit marker written last).
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from checkpoint_states import example_state
from worldpipe.checkpoint import CheckpointCorruptError, CheckpointManager, CheckpointWriteError, state_digest


@dataclass
class Store:
    """A fresh, empty store: its URL and options, and raw access to its bytes by path below the root."""

    url: str
    options: dict
    read: Callable[[str], bytes]
    write: Callable[[str, bytes], None]
    names: Callable[[], list[str]]  # entries directly below the root, hidden ones included
    half_written: Callable[[int], None]  # leave step N as a writer that died before its commit leaves it


def _equal_trees(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        # bitwise (NaN payloads and signed zeros included)
        assert torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))
    elif isinstance(a, dict):
        assert set(a) == set(b), (set(a), set(b))
        for key in a:
            _equal_trees(a[key], b[key])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _equal_trees(x, y)
    else:
        assert a == b, (a, b)


class StoreContract:
    """Cases every checkpoint store passes; a subclass provides the ``store`` fixture."""

    @staticmethod
    def manager(store: Store, **kwargs) -> CheckpointManager:
        return CheckpointManager(store.url, storage_options=store.options, **kwargs)

    def test_round_trip_is_bitwise_and_latest_names_the_newest(self, store):
        states = {step: example_state(seed=step, ema=True, scaler=True, ranks=2) for step in (1, 2, 3)}
        for step, state in states.items():
            self.manager(store).save(step, state)
        assert [i.step for i in self.manager(store).list()] == [2, 3]  # keep_last=2
        assert store.read("latest") == b"step-000003\n"
        loaded = self.manager(store, verify="sha256").load()
        for key in ("model", "optimizer", "scheduler", "scaler", "ema", "progress", "sampler", "identity"):
            _equal_trees(states[3][key], loaded[key])
        assert all(torch.equal(loaded["rng"][r]["torch"], states[3]["rng"][r]["torch"]) for r in (0, 1))
        assert state_digest(loaded) == state_digest(states[3])
        assert self.manager(store).verify(3) == []
        # the optimizer accepts what was loaded
        model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 3))
        model.load_state_dict(loaded["model"])
        torch.optim.AdamW(model.parameters()).load_state_dict(loaded["optimizer"])

    def test_a_half_written_step_is_never_loaded_and_the_next_save_removes_it(self, store):
        cm = self.manager(store, keep_last=3)
        cm.save(1, example_state(seed=1))
        store.half_written(2)
        assert [i.step for i in cm.list()] == [1]
        assert cm.latest_intact() == 1
        assert cm.load()["sampler"]["seed"] == 1
        cm.save(3, example_state(seed=3))
        assert [i.step for i in cm.list()] == [1, 3]
        assert not [name for name in store.names() if "000002" in name], store.names()

    def test_a_flipped_byte_is_named_and_the_step_skipped(self, store, caplog):
        cm = self.manager(store, verify="sha256")
        cm.save(1, example_state(seed=1))
        cm.save(2, example_state(seed=2))
        data = bytearray(store.read("step-000002/optimizer.pt"))
        data[len(data) // 2] ^= 0xFF
        store.write("step-000002/optimizer.pt", bytes(data))
        problems = cm.verify(2)
        assert len(problems) == 1 and "step-000002/optimizer.pt" in problems[0] and "sha256" in problems[0]
        assert cm.verify(1) == []
        assert cm.verify(2, full=False) == []  # sizes cannot see a flipped byte
        with caplog.at_level(logging.WARNING, logger="worldpipe.checkpoint"):
            assert cm.latest_intact() == 1
        assert any("step-000002" in r.getMessage() and "optimizer.pt" in r.getMessage() for r in caplog.records)
        assert cm.load()["sampler"]["seed"] == 1
        with pytest.raises(CheckpointCorruptError, match="optimizer.pt"):
            cm.load(2)

    def test_a_failed_save_leaves_nothing_of_its_step_and_the_previous_latest(self, store, monkeypatch):
        cm = self.manager(store)
        cm.save(1, example_state(seed=1))
        monkeypatch.setenv("WORLDPIPE_CKPT_FAULT", "after_files:raise")
        with pytest.raises(CheckpointWriteError, match="step 2"):
            cm.save(2, example_state(seed=2))
        monkeypatch.delenv("WORLDPIPE_CKPT_FAULT")
        assert not [name for name in store.names() if "000002" in name], store.names()
        assert store.read("latest") == b"step-000001\n"
        assert [i.step for i in cm.list()] == [1]


class TestPosixStore(StoreContract):
    @pytest.fixture
    def store(self, tmp_path):
        root = tmp_path / "ck"

        def write(relpath: str, data: bytes) -> None:
            (root / relpath).write_bytes(data)

        def half_written(step: int) -> None:
            partial = root / f".step-{step:06d}.partial-{uuid.uuid4().hex[:6]}"
            shutil.copytree(root / "step-000001", partial)  # every file there, the rename never made
            (root / f".latest.tmp-{uuid.uuid4().hex[:4]}").write_text(f"step-{step:06d}\n")

        return Store(str(root), {}, lambda relpath: (root / relpath).read_bytes(), write,
                     lambda: sorted(os.listdir(root)), half_written)


class _ObjectStore(StoreContract):
    @staticmethod
    def object_store(url: str, options: dict, fs, path: str) -> Store:
        def read(relpath: str) -> bytes:
            fs.invalidate_cache()
            return fs.cat_file(f"{path}/{relpath}")

        def half_written(step: int) -> None:
            for name in ("model.pt", "optimizer.pt"):
                fs.pipe_file(f"{path}/step-{step:06d}/{name}", read(f"step-000001/{name}"))
            fs.invalidate_cache()

        def names() -> list[str]:
            fs.invalidate_cache()
            return sorted(Path(p).name for p in fs.ls(path, detail=False))

        return Store(url, options, read, lambda relpath, data: fs.pipe_file(f"{path}/{relpath}", data), names,
                     half_written)


class TestMemoryStore(_ObjectStore):
    @pytest.fixture
    def store(self):
        import fsspec

        name = f"ck-{uuid.uuid4().hex}"
        return self.object_store(f"memory://{name}", {}, fsspec.filesystem("memory"), f"/{name}")


class TestS3Store(_ObjectStore):
    @pytest.fixture
    def store(self, moto_endpoint, monkeypatch):
        import s3fs

        for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            monkeypatch.setenv(var, "testing")
        monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
        options = {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": moto_endpoint}}
        fs = s3fs.S3FileSystem(**options)
        bucket = f"b{uuid.uuid4().hex[:12]}"
        fs.mkdir(bucket)
        return self.object_store(f"s3://{bucket}/run/checkpoints", options, fs, f"{bucket}/run/checkpoints")
