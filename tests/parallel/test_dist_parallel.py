"""Real gloo process groups: ring attention and the cross-rank scan communicate correctly, every layout's
training step equals the single-process reference on the same global batch, and the trainer's own step on
unequal slices follows the gradient of the global mean.

The ranks are processes forked from the test (tests/forked_ranks.py), so each case costs its computation, not
the start-up of a torchrun and one interpreter per rank; the checks themselves are in dist_checks.py.

Tolerances: the ring and scan checks run in float64 (1e-10: rounding only). The layout checks run the models
in float32; gradients agree to 1e-5 of the largest gradient, or absolute where that is below 1 (observed: ~3e-7;
reductions are reordered across ranks; the pixel model's loss sums over every pixel, so its gradients reach ~25
and differ by ~3.5e-5 under fsdp2), the loss to 1e-6 relative, parameters after one AdamW step to 1e-6.
"""

import dist_checks
import pytest

from forked_ranks import run_on_ranks

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(("nproc", "chunk", "block"), [(2, 3, 0), (3, 2, 1), (4, 4, 2)])
def test_ring_attention_over_real_ranks(tmp_path, nproc, chunk, block):
    results = run_on_ranks(nproc, dist_checks.check_ring, chunk, block, 7, tmp=tmp_path)
    for rank, r in enumerate(results):
        for key in ("out", "dq", "dk", "dv"):
            assert r[key] < 1e-10, (rank, key, r[key])
        # Forward: N-1 key/value blocks leave every rank (the model (N-1)·S·d_kv/N of bench comm).
        assert r["bytes_sent_forward"] == (nproc - 1) * r["kv_block_bytes"]
        # Backward: blocks with their gradients N-1 times, then the gradients once more.
        assert r["bytes_sent_backward"] == (nproc - 1) * 2 * r["kv_block_bytes"] + r["kv_block_bytes"]
    subblocks = 1 if block == 0 else chunk // block
    skipped_forward = [(nproc - 1 - rank) * subblocks for rank in range(nproc)]
    assert [r["blocks_skipped"] for r in results] == [2 * s for s in skipped_forward]  # forward + backward


def test_scan_over_real_ranks_with_unequal_chunks(tmp_path):
    for rank, r in enumerate(run_on_ranks(3, dist_checks.check_scan, [3, 1, 4], 5, tmp=tmp_path)):
        for key in ("out", "da", "db", "dh0"):
            assert r[key] < 1e-10, (rank, key, r[key])


def assert_matches_reference(results: list[dict]) -> None:
    for r in results:
        assert abs(r["loss"] - r["ref_loss"]) <= 1e-6 * abs(r["ref_loss"]), r
        assert r["grad_diff"] <= 1e-5 * max(1.0, r["grad_scale"]), r
        assert r["param_diff_after_step"] <= 1e-6, r
        assert r["grad_scale"] > 1e-2  # the gradients compared are not all zero


# (model, strategy, tp, cp, global batch, window, micro-batches): batch 5 over 2 data-parallel ranks gives
# unequal slices (3 and 2 windows) with different valid counts; micro=2 accumulates gradients.
TWO_RANKS = {
    "ddp-rssm-unequal-accumulated": ("rssm", "ddp", 1, 1, 5, 8, 2),
    "fsdp2-rssm-unequal": ("rssm", "fsdp2", 1, 1, 5, 8, 1),
    "tp-transformer": ("transformer", "none", 2, 1, 5, 8, 1),
    "cp-transformer": ("transformer", "ddp", 1, 2, 5, 8, 1),
    "cp-ssm-accumulated": ("ssm", "ddp", 1, 2, 5, 8, 2),
    "fsdp2-transformer": ("transformer", "fsdp2", 1, 1, 5, 8, 1),
    # pipeline: 2 stages, GPipe over 4 microbatches of windows with different valid counts (+ pp, schedule)
    "pp-transformer-gpipe": ("transformer", "none", 1, 1, 8, 8, 4, 2, "gpipe"),
    # sequence parallelism inside tp: norms and residual stream on sequence shards (pp 1, then the flag)
    "tp_sp-transformer": ("transformer", "none", 2, 1, 5, 8, 1, 1, "gpipe", "sp"),
    "fsdp2-pixel_rssm-unequal": ("pixel_rssm", "fsdp2", 1, 1, 5, 8, 1),  # conv encoder/decoder, categorical latents
}


@pytest.mark.parametrize("case", sorted(TWO_RANKS))
def test_layout_step_equals_single_process(tmp_path, case):
    results = run_on_ranks(2, dist_checks.check_layout_case, TWO_RANKS[case], tmp=tmp_path)
    assert_matches_reference(results)
    assert all(r["norms_on_mesh"] == (TWO_RANKS[case][-1] == "sp") for r in results)


@pytest.mark.parametrize("case", [("transformer", "fsdp2", 2, 1, 5, 8, 1), ("transformer", "ddp", 1, 2, 5, 8, 1),
                                  ("ssm", "ddp", 1, 2, 6, 8, 1), ("transformer", "fsdp2", 2, 2, 5, 8, 2),
                                  ("transformer", "ddp", 1, 1, 8, 8, 2, 2, "1f1b")],
                         ids=["dp_tp", "dp_cp-transformer", "dp_cp-ssm", "tp_cp", "dp_pp-1f1b"])
def test_two_dimensional_mesh_step_equals_single_process(tmp_path, case):
    results = run_on_ranks(4, dist_checks.check_layout_case, case, tmp=tmp_path)
    assert_matches_reference(results)
    pp = case[7] if len(case) > 7 else 1
    dp = 4 // (case[2] * case[3] * pp)
    assert sorted({r["dp_rank"] for r in results}) == list(range(dp))
    stages = {"pp": pp, "microbatches": case[6], "schedule": case[8]} if pp > 1 else {}
    assert results[0]["layout"] == {"strategy": case[1], "dp": dp, "tp": case[2], "cp": case[3], **stages}


@pytest.mark.parametrize(("tp", "cp"), [(2, 1), (2, 2)], ids=["dp_tp", "tp_cp"])
def test_shard_index_of_a_tensor_parallel_model_covers_every_element_once(tmp_path, tp, cp):
    # 4 gloo ranks, mesh dp×tp or cp×tp = 2×2: tensor-parallel weights are 2-D DTensors on the whole mesh; the
    # modules tp leaves whole are sharded by FSDP over a submesh ("dp", or dp×cp flattened), replicated across tp.
    results = run_on_ranks(4, dist_checks.check_shard_index, tp, cp, 3, tmp=tmp_path)
    first = results[0]
    assert first["on_submesh"] > 0  # the case the index must not double-count is present
    assert first["elements_not_once"] == 0, first
    assert first["value_diff"] == 0.0, first
    # Every rank holds pieces (tp-sharded weights), but only tp coordinate 0 writes the submesh tensors.
    assert all(r["tensors"] == first["tensors"] for r in results)
    counts = [r["pieces_per_rank"] for r in results]
    assert all(c == counts[0] for c in counts)
    assert counts[0][0] > counts[0][1] and counts[0][2] > counts[0][3], counts[0]


def test_trainer_step_on_unequal_slices_follows_the_global_mean_gradient(tmp_path, smoke_dataset):
    """The trainer's own step (not a re-implementation of its loss line) on 2 ranks holding 3 and 2 windows:
    each rank's loss must be scaled by the valid count of the whole global batch, so that the averaged
    gradient equals the single-process gradient of the global mean (a local count would weight ranks wrongly)."""
    store, manifest = smoke_dataset
    results = run_on_ranks(2, dist_checks.check_trainer_step, str(store), str(manifest), str(tmp_path / "run"),
                           tmp=tmp_path)
    assert sorted(r["rows"] for r in results) == [2, 3]
    assert results[0]["local_valid"] != results[1]["local_valid"]
    assert sum(r["local_valid"] for r in results) == results[0]["global_valid"] == results[0]["whole_valid"]
    assert sorted(i for r in results for i in r["sample_index"]) == sorted(results[0]["whole_sample_index"])
    for r in results:
        assert r["grad_scale"] > 1e-3  # the gradients compared are not all zero
        assert r["grad_diff"] <= 1e-5 * max(1.0, r["grad_scale"]), r
        assert abs(r["grad_norm"] - r["ref_grad_norm"]) <= 1e-5 * r["ref_grad_norm"], r
