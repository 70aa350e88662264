"""Every layout trains through the Snakemake pipeline, picked by a `parallel=<layout>` training override.

Real Snakemake on a throwaway copy of the project (tests/pipeline_project.py), real torchrun (gloo). The data
are built once, by the first invocation; each layout then trains an experiment of its own (`layout_<name>`:
a smoke overlay under another name), because a layout is resume-safe: it is not part of a run's identity, so
the same experiment under another layout is the same run, and a finished run has nothing left to train. That
is asserted too: changing only the layout of a finished run plans no job. A pp run also resumes through
Snakemake after losing its last checkpoint, to the same digest.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from pipeline_project import Project
from worldpipe.checkpoint import CheckpointManager, checkpoint_digest
from worldpipe.checkpoint.shards import INDEX_FILE

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1800)]

STEPS = 4
# layout -> (base experiment, world size, what the run records as its layout)
LAYOUTS = {
    "single": ("smoke", 1, {"strategy": "none", "dp": 1, "tp": 1, "cp": 1}),
    "ddp": ("smoke", 2, {"strategy": "ddp", "dp": 2, "tp": 1, "cp": 1}),
    "fsdp2": ("smoke", 2, {"strategy": "fsdp2", "dp": 2, "tp": 1, "cp": 1}),
    "tp": ("smoke_transformer", 2, {"strategy": "none", "dp": 1, "tp": 2, "cp": 1}),
    "cp": ("smoke_transformer", 2, {"strategy": "ddp", "dp": 1, "tp": 1, "cp": 2}),
    "dp_tp": ("smoke_transformer", 4, {"strategy": "fsdp2", "dp": 2, "tp": 2, "cp": 1}),
    "dp_cp": ("smoke_ssm", 4, {"strategy": "ddp", "dp": 2, "tp": 1, "cp": 2}),
    "tp_cp": ("smoke_transformer", 4, {"strategy": "fsdp2", "dp": 1, "tp": 2, "cp": 2}),
    "pp": ("smoke_transformer", 2, {"strategy": "none", "dp": 1, "tp": 1, "cp": 1, "pp": 2, "microbatches": 4,
                                    "schedule": "gpipe"}),
    "dp_pp": ("smoke_transformer", 4, {"strategy": "ddp", "dp": 2, "tp": 1, "cp": 1, "pp": 2, "microbatches": 2,
                                       "schedule": "1f1b"}),
}
# Parameters are DTensors, or each pipeline stage's own: every rank writes its own pieces.
SHARDED = ("fsdp2", "tp", "dp_tp", "tp_cp", "pp", "dp_pp")
PIPELINES = ("pp", "dp_pp")  # the smoke transformer has one block: their experiments get two (one per stage)


def layout_config(repo: Path, layout: str, world_size: int | None = None) -> dict:
    """The smoke pipeline training `layout_<layout>` only, on `layout`, for a few steps."""
    config = yaml.safe_load((repo / "conf/pipeline/smoke.yaml").read_text())
    config["experiments"] = [f"layout_{layout}"]
    config["train"]["nproc_per_node"] = world_size or LAYOUTS[layout][1]
    # Tracking off (resume-safe too): what is tested here is the layout; tests/launch/test_run_identity.py
    # covers the pipeline's MLflow records.
    # Pipelines also save half-way, so that a resume has a checkpoint to start from.
    every = STEPS // 2 if layout in PIPELINES else STEPS
    config["train"]["overrides"] = [f"parallel={layout}", f"trainer.steps={STEPS}", f"checkpoint.every={every}",
                                    "tracking.enabled=false"]
    return config


@pytest.fixture(scope="module")
def project(repo, env_with_venv, tmp_path_factory) -> Project:
    project = Project(repo, tmp_path_factory.mktemp("layouts"), env_with_venv)
    for layout, (base, _, _) in LAYOUTS.items():
        text = (project.src / f"conf/experiment/{base}.yaml").read_text()
        assert f"experiment_name: {base}\n" in text
        overlay = text.replace(f"experiment_name: {base}\n", f"experiment_name: layout_{layout}\n")
        if layout in PIPELINES:
            assert "  layers: 1\n" in overlay
            overlay = overlay.replace("  layers: 1\n", "  layers: 2\n")
        (project.src / f"conf/experiment/layout_{layout}.yaml").write_text(overlay)
    return project


def train_with_snakemake(project: Project, config: dict):
    """Snakemake up to the run's completion record (no evaluation); returns the planned run."""
    project.write_config(config)
    (run,) = project.plan()[1].values()
    proc = project.snakemake(f"{run.dir}/train_done.json")
    assert proc.returncode == 0, proc.stderr[-5000:]
    return run


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_trains_through_the_pipeline(repo, project, layout):
    run = train_with_snakemake(project, layout_config(repo, layout))
    done = json.loads((project.work / run.dir / "train_done.json").read_text())
    assert done["final_step"] == STEPS and done["world_size"] == LAYOUTS[layout][1] and done["digest"]
    if layout in ("single", "ddp", "cp", "dp_cp"):  # replicated parameters: every rank holds the same bits
        assert len(set(done["replica_digests"])) == 1 and done["replica_digests"][0] is not None
    checkpoint = project.work / run.dir / "checkpoints" / f"step-{STEPS:06d}"
    manager = CheckpointManager(checkpoint.parent, verify="sha256")
    identity = manager.load(STEPS, keys=["identity"])["identity"]
    assert identity["parallel_layout"] == {**LAYOUTS[layout][2], "world_size": LAYOUTS[layout][1]}
    assert (checkpoint / INDEX_FILE).is_file() == (layout in SHARDED)
    assert manager.verify(STEPS, full=True) == []
    assert checkpoint_digest(checkpoint.parent) == done["digest"]


def test_changing_only_the_layout_of_a_finished_run_trains_nothing(repo, project):
    project.write_config(layout_config(repo, "single"))
    (before,) = project.plan()[1].values()
    if not (project.work / before.dir / "train_done.json").is_file():  # not trained above (run alone)
        train_with_snakemake(project, layout_config(repo, "single"))
    project.write_config(layout_config(repo, "tp", world_size=2) | {"experiments": ["layout_single"]})
    # The RSSM has no tensor-parallel plan: the pipeline refuses at parse time, naming the key.
    refused = project.snakemake("--dry-run")
    assert refused.returncode != 0 and "parallel.tensor_parallel" in refused.stderr + refused.stdout
    project.write_config(layout_config(repo, "fsdp2") | {"experiments": ["layout_single"]})
    (after,) = project.plan()[1].values()
    assert after.run_hash == before.run_hash  # the same run: the layout is not part of its identity
    dry = project.snakemake(f"{after.dir}/train_done.json", "--dry-run")
    assert dry.returncode == 0, dry.stderr[-3000:]
    assert "Nothing to be done" in dry.stdout + dry.stderr, dry.stdout[-3000:]


# pp only: dp×pp resumes bit-exactly on its layout in test_layouts_resume.py (one Snakemake run less).
@pytest.mark.parametrize("layout", ["pp"])
def test_pipeline_run_resumes_through_the_pipeline(repo, project, layout):
    """A pipeline run that lost its last checkpoint and completion record (killed after the half-way save)
    resumes from the half-way one when Snakemake runs again, and ends with the same digest."""
    config = layout_config(repo, layout)
    project.write_config(config)
    (run,) = project.plan()[1].values()
    done_file = project.work / run.dir / "train_done.json"
    if not done_file.is_file():  # not trained above (run alone)
        train_with_snakemake(project, config)
    straight = json.loads(done_file.read_text())
    checkpoints = project.work / run.dir / "checkpoints"
    assert (checkpoints / f"step-{STEPS // 2:06d}" / INDEX_FILE).is_file()
    half = checkpoints / f"step-{STEPS // 2:06d}"
    written = {p.name: p.stat().st_mtime_ns for p in half.rglob("*") if p.is_file()}
    shutil.rmtree(checkpoints / f"step-{STEPS:06d}")
    done_file.unlink()
    train_with_snakemake(project, config)
    resumed = json.loads(done_file.read_text())
    assert resumed["final_step"] == STEPS
    # Resumed, not retrained: the half-way checkpoint is the one published before.
    assert {p.name: p.stat().st_mtime_ns for p in half.rglob("*") if p.is_file()} == written
    assert resumed["digest"] == straight["digest"] == checkpoint_digest(checkpoints)
