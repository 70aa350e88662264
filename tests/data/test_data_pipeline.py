"""The data stages through Snakemake: fan-out does not change the bytes; the CLI verifies and describes."""

import json
import subprocess
from pathlib import Path

import pytest

from pipeline_project import plan_of

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # two dataset builds: ~23 s


def smoke_datasets(repo: Path) -> dict[str, str]:
    """Directory of each dataset of the smoke pipeline (pendulum and pendulum-heldout), by name."""
    datasets, _ = plan_of(repo, repo / "conf/pipeline/smoke.yaml")
    return {name: dataset.dir for name, dataset in datasets.items()}


def build_with_snakemake(repo: Path, workdir: Path, env: dict, cores: int, jobs: int) -> None:
    targets = [f"{directory}/manifest.json" for directory in smoke_datasets(repo).values()]
    cmd = ["snakemake", *targets, "-s", str(repo / "Snakefile"), "--directory", str(workdir), "--cores", str(cores),
           "--configfile", str(repo / "conf/pipeline/smoke.yaml"), "--config", f"simulate_jobs={jobs}"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]


def store_files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def two_builds(repo, env_with_venv, tmp_path_factory) -> tuple[Path, Path]:
    serial, parallel = tmp_path_factory.mktemp("serial"), tmp_path_factory.mktemp("parallel")
    build_with_snakemake(repo, serial, env_with_venv, cores=1, jobs=1)
    build_with_snakemake(repo, parallel, env_with_venv, cores=2, jobs=3)
    return serial, parallel


def test_fan_out_gives_byte_identical_store(two_builds, repo):
    serial, parallel = two_builds
    dirs = smoke_datasets(repo)
    for directory in dirs.values():
        a = json.loads((serial / directory / "manifest.json").read_text())
        b = json.loads((parallel / directory / "manifest.json").read_text())
        assert a["dataset_hash"] == b["dataset_hash"]
        assert store_files(serial / directory / "store.zarr") == store_files(parallel / directory / "store.zarr")
        assert (serial / directory / "manifest.json").read_bytes() == (parallel / directory / "manifest.json").read_bytes()
    held = json.loads((serial / dirs["pendulum-heldout"] / "manifest.json").read_text())
    assert held["dataset_hash"] != json.loads((serial / dirs["pendulum"] / "manifest.json").read_text())["dataset_hash"]


def test_cli_info_and_verify(two_builds, env_with_venv, tmp_path, repo):
    serial, _ = two_builds
    dataset = serial / smoke_datasets(repo)["pendulum"]
    info = subprocess.run(["worldpipe", "data", "info", str(dataset)], env=env_with_venv, capture_output=True,
                          text=True, timeout=120)
    assert info.returncode == 0, info.stderr
    manifest = json.loads((dataset / "manifest.json").read_text())
    assert manifest["dataset_hash"] in info.stdout
    assert "episodes" in info.stdout

    ok = subprocess.run(["worldpipe", "data", "verify", str(dataset)], env=env_with_venv, capture_output=True,
                        text=True, timeout=120)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert " 0 problem(s)" in ok.stdout

    # Corrupt one shard of a copy: verify names exactly that file and fails.
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-r", str(dataset), str(copy)], check=True)
    shard = next(p for p in sorted((copy / "store.zarr" / "obs").rglob("*")) if p.is_file() and p.name != "zarr.json")
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF
    shard.write_bytes(bytes(data))
    bad = subprocess.run(["worldpipe", "data", "verify", str(copy)], env=env_with_venv, capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 1
    flagged = [line for line in bad.stdout.splitlines() if not line.strip().startswith("ok")]
    assert any(str(shard.relative_to(copy / "store.zarr")) in line for line in flagged), bad.stdout


def test_the_test_suites_datasets_are_the_data_commands_datasets(tmp_path, env_with_venv):
    """tests/datasets.py builds in-process; `worldpipe data init/write/seal` must give the same dataset."""
    from datasets import SMOKE_SPEC, build_dataset, build_dataset_with_the_cli

    spec = {**SMOKE_SPEC, "episodes": 8}
    _, in_process = build_dataset(tmp_path / "library", spec=spec)
    _, by_cli = build_dataset_with_the_cli(tmp_path / "cli", env_with_venv, spec)
    assert json.loads(in_process.read_text())["dataset_hash"] == json.loads(by_cli.read_text())["dataset_hash"]
