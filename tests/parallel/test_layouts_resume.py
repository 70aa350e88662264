"""Sharded resume on the context-parallel, pipeline and 2-D layouts (real gloo groups of 2 or 4 ranks).

For cp, dp×tp, dp×cp, pp and dp×pp: a run of 2N steps saving every N steps (sharded: every parameter a DTensor) is the
uninterrupted reference; its step-N checkpoint, copied alone into a fresh run directory, is exactly what a run
interrupted after step N leaves behind, and resuming from it on the same layout must end with the reference's
digest, bit for bit (same layout, same reduction order). The step-N checkpoints then resume onto other
layouts (dp×tp onto cp×tp: the 2-D mesh's pieces re-cut for another 2-D mesh; dp×cp onto one process: all
pieces into plain tensors; pp onto one process: the stages joined; dp×pp onto fsdp2: the stages' tensors
re-cut into FSDP2's row blocks), ending within the tolerance below of the reference, and verify and digest through
`worldpipe ckpt`, with the digest of the same state saved full.

cp and dp×cp train with ``parallel.strategy=fsdp2`` here: the shipped cp/dp_cp layouts replicate parameters
(DDP), and a replicated model is saved full by rank 0, which the full-checkpoint resume tests already cover.

Tensor parallel alone resumes bit-exactly (and onto FSDP2), and FSDP2 onto DDP, in test_sharded_training.py.

Each training is `worldpipe train` with its ranks forked from the test (tests/forked_ranks.py: the launcher's
checks and record, then the torchrun worker's body on every rank), not started by torchrun: 13 trainings of
up to 4 ranks cost their steps instead of a torchrun and one interpreter per rank each. Every layout is trained
under real torchrun through Snakemake in test_layouts_pipeline.py.
"""

from __future__ import annotations

import shutil

import pytest

from forked_ranks import train_on_ranks
from worldpipe.checkpoint import CheckpointManager, checkpoint_digest
from worldpipe.checkpoint.shards import INDEX_FILE
from worldpipe.cli import main as cli_main

pytestmark = [pytest.mark.integration, pytest.mark.slow]

HALF = 6  # N: steps before the checkpoint resumed from (the reference runs 2N)
# layout -> (experiment, extra overrides): the transformer's ring attention on cp, its tensor-parallel plan on
# dp×tp, the state-space model's cross-rank scan on dp×cp.
CASES = {
    "cp": ("smoke_transformer", ("parallel.strategy=fsdp2",)),
    "dp_tp": ("smoke_transformer", ()),
    "dp_cp": ("smoke_ssm", ("parallel.strategy=fsdp2",)),
    # pipelines: plain tensors, each stage's on its own ranks (saved per stage, replicas written once); the
    # smoke transformer gets a second block so that there is a boundary to cut at
    "pp": ("smoke_transformer", ("model.layers=2",)),
    "dp_pp": ("smoke_transformer", ("model.layers=2",)),
}
# Another layout only reorders floating-point reductions of the same global batches (the batch is
# world-size invariant): the resumed parameters must end within 2% of the distance the reference's moved in
# the second half (observed 0.14% for dp×tp onto cp×tp, <0.01% for dp×cp onto one process; a lost optimizer
# state or a shifted sampler moves them tens of percent).
CROSS_LAYOUT_RTOL = 0.02


def step_dir(run_dir, step: int):
    return run_dir / "checkpoints" / f"step-{step:06d}"


def train(run_dir, dataset, experiment: str, layout: str, *extra: str) -> dict:
    """`worldpipe train` of 2N steps, a checkpoint every N, on forked ranks; returns the completion record."""
    store, manifest = dataset
    return train_on_ranks([f"experiment={experiment}", f"parallel={layout}", f"run_dir={run_dir}",
                           f"data.store={store}", f"data.manifest={manifest}", "tracking.enabled=false",
                           "trainer.progress_bar=false", f"trainer.steps={2 * HALF}", f"checkpoint.every={HALF}",
                           *extra], tmp=run_dir.parent / f"{run_dir.name}-ranks")


def resume_from(checkpoint, run_dir) -> None:
    """A fresh run directory holding only ``checkpoint``: what a run killed right after it leaves."""
    (run_dir / "checkpoints").mkdir(parents=True)
    shutil.copytree(checkpoint, run_dir / "checkpoints" / checkpoint.name)


def distance(a: dict, b: dict) -> float:
    return sum(float((a[k] - b[k]).pow(2).sum()) for k in a if a[k].is_floating_point()) ** 0.5


@pytest.fixture(scope="module")
def references(tmp_path_factory, smoke_dataset) -> dict:
    """The uninterrupted 2N-step run of every case."""
    out = {}
    for layout, (experiment, extra) in CASES.items():
        run_dir = tmp_path_factory.mktemp(f"straight_{layout}")
        train(run_dir, smoke_dataset, experiment, layout, *extra)
        out[layout] = run_dir
    return out


# pp resumes on its own layout through Snakemake (test_layouts_pipeline.py), to the same digest.
@pytest.mark.parametrize("layout", [layout for layout in CASES if layout != "pp"])
def test_sharded_resume_on_the_same_layout_is_bit_exact(tmp_path, references, smoke_dataset, layout):
    experiment, extra = CASES[layout]
    straight = references[layout]
    assert (step_dir(straight, HALF) / INDEX_FILE).is_file(), "the checkpoint resumed from is not sharded"
    resumed = tmp_path / "resumed"
    resume_from(step_dir(straight, HALF), resumed)
    done = train(resumed, smoke_dataset, experiment, layout, *extra)
    assert done["final_step"] == 2 * HALF
    # Step N is still the copied one (the run resumed rather than starting over).
    assert CheckpointManager(resumed / "checkpoints").load(HALF, keys=["identity"])["identity"]["parallel_layout"] \
        == CheckpointManager(straight / "checkpoints").load(HALF, keys=["identity"])["identity"]["parallel_layout"]
    assert checkpoint_digest(resumed / "checkpoints") == checkpoint_digest(straight / "checkpoints")
    assert done["digest"] == checkpoint_digest(straight / "checkpoints")


@pytest.mark.parametrize(("source", "target", "experiment"),
                         [("dp_tp", "tp_cp", "smoke_transformer"), ("dp_cp", "single", "smoke_ssm"),
                          ("pp", "single", "smoke_transformer"), ("dp_pp", "fsdp2", "smoke_transformer")])
def test_sharded_checkpoint_resumes_onto_another_layout(tmp_path, references, smoke_dataset, source, target,
                                                        experiment):
    straight = references[source]
    resumed = tmp_path / "resumed"
    resume_from(step_dir(straight, HALF), resumed)
    model_keys = tuple(o for o in CASES[source][1] if o.startswith("model."))  # the same model, other layout
    done = train(resumed, smoke_dataset, experiment, target, *model_keys)
    assert done["final_step"] == 2 * HALF
    manager, reference = CheckpointManager(resumed / "checkpoints"), CheckpointManager(straight / "checkpoints")
    source_layout = reference.load(HALF, keys=["identity"])["identity"]["parallel_layout"]
    target_layout = manager.load(2 * HALF, keys=["identity"])["identity"]["parallel_layout"]
    assert source_layout != target_layout, (source_layout, target_layout)
    # Resumed, not restarted (a deterministic restart would also end near the reference): step N is the copy.
    assert manager.load(HALF, keys=["identity"])["identity"]["parallel_layout"] == source_layout
    end, expected = manager.load(2 * HALF)["model"], reference.load(2 * HALF)["model"]
    moved = distance(expected, reference.load(HALF)["model"])
    assert moved > 0
    print(f"{source} -> {target}: distance {distance(end, expected):.3g} of {moved:.3g} moved "
          f"({distance(end, expected) / moved:.2%})")
    assert distance(end, expected) <= CROSS_LAYOUT_RTOL * moved, (distance(end, expected), moved)


@pytest.mark.parametrize("layout", list(CASES))
def test_sharded_checkpoint_verifies_and_digests_as_if_saved_full(tmp_path, references, capsys, layout):
    straight = references[layout]
    assert cli_main(["ckpt", "verify", str(straight)]) == 0
    capsys.readouterr()
    assert cli_main(["ckpt", "digest", str(straight), "--step", str(HALF)]) == 0
    printed = capsys.readouterr().out.strip()
    sharded = CheckpointManager(straight / "checkpoints")
    assert (step_dir(straight, HALF) / INDEX_FILE).is_file()
    # The same state published full (one file set, no shards): the digest is over the logical state.
    full = CheckpointManager(tmp_path / "full")
    full.save(HALF, sharded.load(HALF))
    full.wait()
    assert not (tmp_path / "full" / f"step-{HALF:06d}" / INDEX_FILE).exists()
    assert printed == checkpoint_digest(tmp_path / "full", HALF) == checkpoint_digest(straight / "checkpoints", HALF)
    # A different step of the same run digests differently (the comparison can fail).
    assert checkpoint_digest(straight / "checkpoints", 2 * HALF) != printed
