"""Numerics identity, with real training processes: the portable mode's bits hold whatever code path the
environment forces, a rerun on another MKL code path names the difference and is judged within tolerance, a
portable rerun under the same forcing is bit-identical, and a resume onto another environment is never silent.

The "other machine" is made here the way an AVX2-only or AVX-512 node differs: by forcing MKL's code path
(``MKL_CBWR``) and ATen's CPU capability in the environment of the command, as a shell would.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from mlflow_support import BIN
from worldpipe.checkpoint import checkpoint_digest
from worldpipe.pipeline.run_index import numerics_lines

pytestmark = pytest.mark.integration

# Forced code paths: an AVX2-only node's MKL and ATen, an AVX-512 node's, MKL's own choice with ATen's baseline.
FORCED = [{"MKL_CBWR": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}, {"MKL_CBWR": "AVX512", "ATEN_CPU_CAPABILITY": "avx512"},
          {"MKL_CBWR": "AUTO", "ATEN_CPU_CAPABILITY": "default"}]


def _train(run_dir: Path, dataset, env: dict, *extra: str, uri: str = "", forced: dict | None = None):
    tracking = [f"tracking.uri={uri}"] if uri else ["tracking=none"]
    cmd = [str(BIN / "worldpipe"), "train", "experiment=smoke", f"run_dir={run_dir}", f"data.store={dataset[0]}",
           f"data.manifest={dataset[1]}", "trainer.progress_bar=false", "parallel.nproc_per_node=1",
           "trainer.steps=10", "checkpoint.every=5", *tracking, *extra]
    return subprocess.run(cmd, env={**env, **(forced or {})}, cwd=run_dir.parent, capture_output=True, text=True,
                          timeout=300)


def _train_portable(run_dir: Path, dataset, env: dict, forced: dict) -> str:
    """A portable run under ``forced`` variables, checked to have recorded the pinned code paths; its digest."""
    proc = _train(run_dir, dataset, env, "numerics=portable", forced=forced)
    assert proc.returncode == 0, proc.stderr[-3000:]
    manifest = json.loads((run_dir / "checkpoints" / "step-000010" / "MANIFEST.json").read_text())
    recorded = manifest["identity"]["numerics"]
    assert (recorded["mkl.cbwr"], recorded["aten.cpu_capability"]) == ("COMPATIBLE", "AVX2")
    assert manifest["identity"]["config"]["numerics"]["mode"] == "portable"
    assert manifest["identity"]["config"]["numerics"]["fused_optimizer"] is True
    return checkpoint_digest(run_dir / "checkpoints")


@pytest.fixture(scope="module")
def portable_reference(tmp_path_factory, smoke_dataset, env_with_venv) -> str:
    """The portable run whose variables are set already (it trains in the launcher's own process): the digest
    every forced variant must give."""
    pinned = {"MKL_CBWR": "COMPATIBLE", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    return _train_portable(tmp_path_factory.mktemp("portable") / "pinned", smoke_dataset, env_with_venv, pinned)


# One forced code path in the default tier (a launcher that pins nothing records it, and its bits differ), the
# other two in the slow tier. Each trains in fresh processes: the launcher pins before torch computes, and a
# launcher that pinned late hands training to torchrun.
@pytest.mark.parametrize("forced", [FORCED[1], pytest.param(FORCED[0], marks=pytest.mark.slow),
                                    pytest.param(FORCED[2], marks=pytest.mark.slow)],
                         ids=["avx512", "avx2", "auto"])
def test_portable_digests_are_equal_whatever_code_path_the_environment_forces(forced, tmp_path, smoke_dataset,
                                                                               env_with_venv, portable_reference):
    assert _train_portable(tmp_path / "portable", smoke_dataset, env_with_venv, forced) == portable_reference


@pytest.fixture(scope="module")
def recorded_runs(tmp_path_factory, smoke_dataset, env_with_venv):
    """A native and a portable smoke run, recorded in one SQLite MLflow (on this machine's own code paths)."""
    root = tmp_path_factory.mktemp("numerics")
    data = root / "data"
    shutil.copytree(Path(smoke_dataset[0]).parent, data)
    dataset = (data / "store.zarr", data / "manifest.json")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    runs = {}
    for mode in ("native", "portable"):
        run_dir = root / mode
        proc = _train(run_dir, dataset, env_with_venv, f"numerics={mode}", uri=uri)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[mode] = json.loads((run_dir / "train_done.json").read_text())["mlflow_run_id"]
    return {"root": root, "uri": uri, "runs": runs, "dataset": dataset}


def _rerun(recorded, mode: str, name: str, env: dict, forced: dict) -> subprocess.CompletedProcess:
    root = recorded["root"]
    return subprocess.run([str(BIN / "worldpipe"), "rerun", recorded["runs"][mode], "--tracking-uri",
                           recorded["uri"], "--run-dir", str(root / name)], env={**env, **forced}, cwd=root,
                          capture_output=True, text=True, timeout=400)


@pytest.mark.slow
def test_recorded_run_carries_its_numerics_environment_as_tags(recorded_runs):
    tags = MlflowClient(recorded_runs["uri"]).get_run(recorded_runs["runs"]["native"]).data.tags
    for field in ("cpu.model", "cpu.isa", "aten.cpu_capability", "blas", "mkl.cbwr", "onednn.max_cpu_isa",
                  "torch.threads", "torch.deterministic", "device"):
        assert tags.get(f"worldpipe.numerics.{field}"), field
    assert tags["worldpipe.numerics.torch.threads"] == "1" and tags["worldpipe.numerics.device"] == "cpu"
    assert numerics_lines(recorded_runs["root"] / "native")[0].startswith("numerics ")


@pytest.mark.slow
def test_rerun_on_another_mkl_code_path_names_it_and_is_equivalent(recorded_runs, env_with_venv):
    proc = _rerun(recorded_runs, "native", "rerun-avx2", env_with_venv, {"MKL_CBWR": "AVX2"})
    before_training = [line for line in proc.stdout.splitlines() if line.startswith("numerics environment differs")]
    assert before_training and "mkl.cbwr: recorded 'AUTO', here 'AVX2'" in before_training[0], proc.stdout
    verdict = proc.stdout.strip().splitlines()[-1]
    if proc.returncode == 0:  # a CPU whose MKL runs the AVX2 path by itself: the bits match anyway
        assert verdict.startswith("bit-identical") and "different numerics environment" in verdict
    else:
        assert proc.returncode == 3, proc.stdout[-2000:] + proc.stderr[-2000:]
        assert verdict.startswith("equivalent on a different numerics environment (mkl.cbwr"), verdict
        assert "rtol" in verdict or "metric histories identical" in verdict  # then the final digests differ
        assert "open-loop error ratio at horizon" in verdict
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_portable_rerun_under_another_forced_code_path_is_bit_identical(recorded_runs, env_with_venv):
    proc = _rerun(recorded_runs, "portable", "rerun-portable", env_with_venv,
                  {"MKL_CBWR": "AVX2", "ATEN_CPU_CAPABILITY": "default"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "numerics environment differs" not in proc.stdout
    assert proc.stdout.strip().splitlines()[-1].startswith("bit-identical")


@pytest.mark.slow
def test_resume_on_another_environment_warns_and_is_recorded(recorded_runs, env_with_venv):
    """Resuming the native run with more steps (a resume-safe change) under another MKL code path: one warning
    line naming the field, a tag on the same MLflow run, and `worldpipe runs list`'s line for the run dir."""
    run_dir = recorded_runs["root"] / "native"
    proc = _train(run_dir, recorded_runs["dataset"], env_with_venv, "numerics=native", "trainer.steps=15",
                  uri=recorded_runs["uri"], forced={"MKL_CBWR": "AVX2"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings = [line for line in proc.stderr.splitlines() if "different numerics environment" in line]
    assert len(warnings) == 1 and "resuming step 10" in warnings[0] and "mkl.cbwr" in warnings[0], proc.stderr
    tags = MlflowClient(recorded_runs["uri"]).get_run(recorded_runs["runs"]["native"]).data.tags
    assert tags["worldpipe.numerics.changed"] == "step 10: mkl.cbwr"
    assert tags["worldpipe.numerics.mkl.cbwr"] == "AVX2"
    assert any("resumed at step 10 on a different numerics environment: mkl.cbwr" in line
               for line in numerics_lines(run_dir))
