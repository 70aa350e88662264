"""The project's other durable stores under a simulated power cut: the tracking spool, the run index (``run.json``,
``latest``) with the run's first checkpoint, the run lock, and the zarr data store's build and seal. Each workload
runs once on the crash-simulating file system; every state a cut could leave is then recovered as a user would."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from checkpoint_states import example_state
from crashfs.replay import checkpoint_acks, sweep
from worldpipe.checkpoint.manager import CheckpointManager
from worldpipe.config import paths
from worldpipe.launch.run_lock import RunLock
from worldpipe.pipeline.plan import plan
from worldpipe.tracking.spool import Spool

pytestmark = pytest.mark.crash

REPO = Path(__file__).resolve().parents[2]
BLOB = bytes(range(256)) * 300  # binary and over the inline limit: journaled as a blob file


def spool_batches(count: int) -> list[list[tuple]]:
    """``count`` batches of records as a training run appends them (one journal write and fsync each): params,
    staged metrics of growing size (lines that cross 512 B and 4 KiB boundaries, so a cut can tear them), commits
    carrying a blob artifact, and a checkpoint's commit, inline artifacts and tags whose lines together are longer
    than one write (the file system gets them in two: a cut may keep a part of the second only)."""
    batches = [[("params", None, {"params": {"trainer.lr": "0.001"}})]]
    for i in range(1, count):
        if i == 4:
            views = {f"ckpt/view-{k}.txt": f"{k}".encode() * 60_000 for k in range(3)}
            batches.append([("commit", None, {"step": i}), ("artifacts", views, {"path": "ckpt"}),
                            ("tags", None, {"tags": {"step": str(i)}})])
        elif i % 3 == 2:
            batches.append([("commit", {f"ckpt/{i}.bin": BLOB[i:] + BLOB[:i]}, {"step": i})])
        else:
            batches.append([("metrics", None, {"gate": i, "metrics": [[i, "loss", 1.0 / i, 1000 + i]] * (1 + 7 * i % 90)})])
    return batches


def record_spool(crashfs, count: int) -> tuple[dict, dict, list[tuple[int, int]]]:
    """The batches appended to a run's spool, its acknowledgement state saved now and then; per sequence number,
    the log length at which its append returned, the record's fields and files; and (log length, acked) per
    state saved."""
    spool = Spool(crashfs.path / "run")
    acked, states = {}, []
    for batch in spool_batches(count):
        seqs = spool.append_many(batch)
        for seq, (op, files, fields) in zip(seqs, batch, strict=True):
            acked[seq] = (crashfs.length(), {"op": op, **fields}, files or {})
        if len(acked) % 4 == 3:
            last = max(acked)
            with spool.locked():
                state = spool.state()
                state.update(acked=last - 1, offset=spool.read()[last - 2][1], run_id="r1")
                spool.save_state(state)
            states.append((crashfs.length(), last - 1))
    return crashfs.recording(), acked, states


@pytest.mark.parametrize("count", [pytest.param(5, id="5-records"),
                                   pytest.param(60, id="60-records", marks=pytest.mark.slow)])
def test_every_cut_of_the_spool_keeps_every_acknowledged_record(crashfs, tmp_path, count):
    recording, acked, states = record_spool(crashfs, count)

    def check(run, state) -> None:
        spool = Spool(run)
        records = {r["seq"]: r for r in spool.records()}
        for seq, (at, fields, files) in acked.items():
            if at > state.done:
                continue
            assert seq in records, f"record {seq} ({fields['op']}) was appended durably, but the journal lost it"
            assert {k: records[seq].get(k) for k in fields} == fields, f"record {seq} came back changed"
            for name, data in files.items():
                if name in records[seq].get("inline", {}):
                    assert records[seq]["inline"][name].encode() == data, f"{name} of record {seq} changed"
                    continue
                blob = spool.blob_dir(seq) / name
                assert blob.is_file() and blob.read_bytes() == data, f"blob {name} of record {seq} lost"
        saved = [n for at, n in states if at <= state.done]
        if saved:
            assert spool.state()["acked"] >= max(saved), "the acknowledgement state was saved durably, but is lost"
        spool.state()  # never torn: parses whatever survived
        assert spool.append("params", params={"after": "crash"}) == max(records, default=0) + 1

    result = sweep(recording, check, tmp_path, subdir="run")
    print(f"crashfs tracking spool, {count} records: {result.summary()}")


def test_every_cut_of_a_run_start_keeps_its_record_latest_and_first_checkpoint(crashfs, tmp_path, monkeypatch):
    from worldpipe.pipeline.plan import launch_overrides
    from worldpipe.pipeline.run_index import begin, end, experiment_runs

    monkeypatch.chdir(crashfs.path)
    monkeypatch.delenv(paths.CONF_DIR_ENV, raising=False)
    run = plan(yaml.safe_load((REPO / "conf/pipeline/default.yaml").read_text()), REPO / "conf")[1]["pendulum_rssm"]
    begin(run.dir, run.dataset.spec_hash, launch_overrides(run))
    begun = crashfs.length()
    with RunLock(run.dir):
        locked = crashfs.length()
        with CheckpointManager(paths.checkpoints_dir(run.dir)) as manager:
            manager.save(1, example_state(seed=1))
        saved = crashfs.length()
    end(run.dir, 0)
    ended = crashfs.length()
    monkeypatch.chdir(tmp_path)
    recording = crashfs.recording()
    assert checkpoint_acks(recording["log"], paths.checkpoints_dir(run.dir))
    run_rel = Path(run.dir)

    def check(root, state) -> None:
        done = state.done
        run_dir, experiment = root / run_rel, root / run_rel.parent
        if begun <= done:
            runs = experiment_runs(experiment) if experiment.is_dir() else []
            assert [r.path.name for r in runs] == [run_rel.name], "the run was begun, but `runs list` lost it"
            assert os.readlink(experiment / paths.LATEST_LINK) == run_rel.name, "`latest` lost the run"
        if saved <= done:
            step = CheckpointManager(run_dir / "checkpoints", verify="sha256").latest_loadable()
            assert step == 1, f"step 1 was reported durable, but resume finds {step}"
        if ended <= done:
            record = json.loads((run_dir / paths.RUN_RECORD).read_text())
            assert record["attempts"][-1]["exit_code"] == 0, "the attempt's end was recorded, but it is lost"
        if locked <= done or run_dir.is_dir():
            with RunLock(run_dir):  # whatever the lock file holds after the cut, a new run takes it
                pass

    result = sweep(recording, check, tmp_path)
    print(f"crashfs run index, run lock and first checkpoint: {result.summary()}")


TINY_SPEC = {"name": "tiny", "env_id": "Pendulum-v1", "policy": "noisy_controller", "episodes": 4, "max_steps": 8,
             "episodes_per_shard": 2, "seed": 0, "pixels": False, "pixel_size": 32, "compressor": "zstd"}


def test_every_cut_of_a_dataset_build_leaves_it_sealed_and_verified_or_unsealed(crashfs, tmp_path):
    from omegaconf import OmegaConf

    from worldpipe.data.build import build_dataset
    from worldpipe.data.manifest import load_manifest, verify_dataset
    from worldpipe.data.spec import DatasetSpec
    from worldpipe.data.store import TrajectoryStore
    from worldpipe.launch.preflight import DataMismatch, check_data

    where = Path("results/data/tiny/0123abcd")
    build_dataset(str(crashfs.path / where / "store.zarr"), DatasetSpec.from_dict(TINY_SPEC),
                  manifest_path=str(crashfs.path / where / "manifest.json"))
    sealed = crashfs.length()
    recording = crashfs.recording()

    def check(root, state) -> None:
        store, manifest = root / where / "store.zarr", root / where / "manifest.json"
        if sealed <= state.done:
            assert manifest.is_file(), "the dataset was sealed, but its manifest is lost"
        if not manifest.is_file():  # unsealed: training refuses it in one line (the pipeline's rule rebuilds it)
            data = OmegaConf.create({"data": {"store": str(store), "manifest": str(manifest)}})
            with pytest.raises(DataMismatch, match="no dataset manifest"):
                check_data(data)
        else:
            bad = [r for r in verify_dataset(str(store), str(manifest)) if r["status"] != "ok"]
            assert not bad, f"a sealed dataset does not verify: {bad[:3]}"
            TrajectoryStore.open(str(store), manifest=load_manifest(str(manifest))).read_episodes(0, 4)

    result = sweep(recording, check, tmp_path)
    print(f"crashfs data store, build and seal: {result.summary()}")


@pytest.mark.slow  # MLflow makes its tables in ~40 s on the file system in Python
def test_every_cut_of_the_mlflow_store_creation_leaves_no_store_or_a_whole_one(crashfs, tmp_path):
    from mlflow.tracking import MlflowClient

    from worldpipe.tracking.connection import create_sqlite_store

    db = Path("results/mlflow.db")
    create_sqlite_store(crashfs.path / db)
    created = crashfs.length()
    recording = crashfs.recording()

    def check(root, state) -> None:
        if created <= state.done:
            assert (root / db).is_file(), "the store was created, but a cut lost it"
        if (root / db).is_file():  # whole: MLflow opens it and finds its tables
            MlflowClient(tracking_uri=f"sqlite:///{root / db}").search_experiments(max_results=1)

    result = sweep(recording, check, tmp_path)
    print(f"crashfs MLflow SQLite store creation: {result.summary()}")
