"""Issue 19, cases 2 and 3 on sharded checkpoints (FSDP2 in one process, a one-rank gloo group): an index whose
pieces overlap, an index whose shape disagrees with the model, a shard file holding a pickle with code, an index
piece naming a file of another step, and a shard that is a symlink out of its step. Each is forged with every
checksum re-computed; each must fail `ckpt verify` naming the damage, and every reader must fall back to the
intact step before it. (Multi-rank resume onto such a step: tests/checkpoint/test_loadable_resume.py.)
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from checkpoint_states import rehash_step
from sharded_support import fsdp_toy_model
from worldpipe.checkpoint import CheckpointCorruptError, CheckpointManager, checkpoint_digest
from worldpipe.checkpoint.resharding import load_resharded
from worldpipe.checkpoint.sharded_saver import ShardedSaver
from worldpipe.checkpoint.shards import INDEX_FILE, shard_file
from worldpipe.cli import main as cli

pytestmark = pytest.mark.adversarial


def model_shapes(model) -> dict[str, list[int]]:
    """What the trainer hands the checkpoint reader: its live model's logical tensor shapes."""
    return {name: list(tensor.shape) for name, tensor in model.state_dict().items()}




@pytest.fixture
def run(one_rank_group, tmp_path) -> Path:
    """Sharded steps 1 and 2 of one model; returns the checkpoints directory."""
    model, opt = fsdp_toy_model()
    root = tmp_path / "ck"
    saver = ShardedSaver(CheckpointManager(root, keep_last=3))
    for step in (1, 2):
        saver.save(step, {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, opt),
                          "scheduler": None, "scaler": None, "ema": None,
                          "progress": {"step": step, "epoch": 0, "samples_seen": 4 * step, "tokens_seen": 0},
                          "sampler": {"cursor": 4 * step}, "rng": [], "identity": {"run": "t"}})
        model(torch.randn(4, 6)).square().mean().backward()
        opt.step()
    saver.manager.close()
    return root


def _edit_index(step_dir: Path, edit) -> None:
    index = json.loads((step_dir / INDEX_FILE).read_text())
    edit(index["tensors"][0])  # model/0.weight: logical shape [7, 6], one piece (one rank)
    (step_dir / INDEX_FILE).write_text(json.dumps(index))


def _overlapping(entry: dict) -> None:
    # Two pieces of 4 and 3 rows: 42 elements, as many as the tensor has, but rows 2-3 twice and rows 5-6 never.
    piece = entry["pieces"][0]
    entry["pieces"] = [{**piece, "offset": [0, 0], "shape": [4, 6]}, {**piece, "offset": [2, 0], "shape": [3, 6]}]


def _doubled(step_dir: Path) -> None:
    # A consistent forgery: the index, its piece and the shard's tensor all say [14, 6]; only the record of the
    # model's shape (manifest) and the model itself can tell.
    shard = step_dir / shard_file(0)
    pieces = torch.load(shard, weights_only=True)
    key = json.loads((step_dir / INDEX_FILE).read_text())["tensors"][0]["pieces"][0]["key"]
    pieces[key] = torch.cat([pieces[key], pieces[key]])
    torch.save(pieces, shard)

    def edit(entry):
        entry["shape"] = [14, 6]
        entry["pieces"][0]["shape"] = [14, 6]

    _edit_index(step_dir, edit)


class Payload:
    """A pickled object of a class that `torch.load(weights_only=True)` rightly refuses to build."""


def _pickle_with_code(step_dir: Path) -> None:
    torch.save({"0": Payload()}, step_dir / shard_file(0))


def _escaping_piece(step_dir: Path) -> None:
    def edit(entry):
        entry["pieces"][0]["file"] = f"../step-000001/{shard_file(0)}"

    _edit_index(step_dir, edit)


def _symlinked_shard(step_dir: Path) -> None:
    shard = step_dir / shard_file(0)
    shard.unlink()
    shard.symlink_to(step_dir.parent / "step-000001" / shard_file(0))


CASES = {
    "overlapping pieces": (lambda d: _edit_index(d, _overlapping), f"{INDEX_FILE}: model/0.weight: pieces overlap"),
    "index shape != model": (_doubled, f"{INDEX_FILE}: 0.weight: shape [14, 6] float32 where the manifest records "
                                       "[7, 6] float32"),
    "pickle with code": (_pickle_with_code, f"{shard_file(0)}: cannot load (refused by the weights-only loader: "
                                            "Unsupported global: GLOBAL test_checkpoint_loadable_sharded.Payload"),
    "piece in another step": (_escaping_piece, f"{INDEX_FILE}: model/0.weight: piece file "
                                               "'../step-000001/shards/rank-00000.pt' is not a shard file of this step"),
    "symlink out of the step": (_symlinked_shard, f"{shard_file(0)}: unreadable (resolves outside its step "
                                                  "directory"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_forged_sharded_step_fails_verify_and_every_reader_falls_back(case, run, capsys, caplog):
    damage, problem = CASES[case]
    intact = checkpoint_digest(run, 1)
    damage(run / "step-000002")
    rehash_step(run / "step-000002")
    if case != "symlink out of the step":  # that one: hashing already refuses to follow the link
        assert CheckpointManager(run, verify="sha256").verify(2) == []  # every checksum matches

    rc = cli(["ckpt", "verify", str(run)])
    out = capsys.readouterr().out
    assert rc == 1 and "step 1: ok" in out and "step 2: FAILED" in out, out
    assert f"step-000002/{problem}" in out, out
    assert all(line.startswith(("step ", "  ")) for line in out.splitlines())  # one line per problem

    with caplog.at_level(logging.WARNING, logger="worldpipe.checkpoint"):
        assert checkpoint_digest(run) == intact
        model, opt = fsdp_toy_model(seed=3)
        assert CheckpointManager(run).latest_loadable(model_shapes(model)) == 1
    skipped = [r.getMessage() for r in caplog.records]
    assert len(skipped) == 2 and all(m.startswith(f"skipping checkpoint {run}/step-000002: ") for m in skipped)
    assert all("\n" not in m for m in skipped)


def test_the_model_being_loaded_decides_even_without_a_recorded_table(run):
    """A step written before manifests recorded tensor shapes: the live model's shapes still refuse it."""
    step_dir = run / "step-000002"
    _doubled(step_dir)
    manifest = json.loads((step_dir / "MANIFEST.json").read_text())
    del manifest["tensors"]
    (step_dir / "MANIFEST.json").write_text(json.dumps(manifest))
    rehash_step(step_dir)
    assert CheckpointManager(run).latest_loadable() == 2  # nothing to compare with but itself
    model, _ = fsdp_toy_model(seed=3)
    assert CheckpointManager(run).latest_loadable(model_shapes(model)) == 1


def test_loading_never_reads_a_piece_outside_its_step(run):
    """Even when asked for the forged step directly, the reader refuses the escaping path instead of reading it."""
    _escaping_piece(run / "step-000002")
    rehash_step(run / "step-000002")
    model, opt = fsdp_toy_model(seed=3)
    with pytest.raises(CheckpointCorruptError, match="resolves outside its step directory"):
        load_resharded(CheckpointManager(run), 2, model, opt)
