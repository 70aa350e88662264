"""Planner arithmetic on the smoke transformer's facts: ZeRO sharding with FSDP2 padding, tensor-parallel
splits, the collectives of each layout, refusals with validate_layout's reason, and the budget ranking."""

from __future__ import annotations

import pytest

from worldpipe.models.transformer import CausalTransformer
from worldpipe.parallel import forecast
from worldpipe.parallel.forecast import Degrees
from worldpipe.parallel.forward_memory import ForwardShape, measure_forwards

CFG = {"model": {"_target_": "worldpipe.models.transformer.CausalTransformer", "width": 16, "heads": 2,
                 "layers": 1, "mlp_ratio": 2},
       "data": {"window": 16}, "trainer": {"batch_size": 8}}
PARAMS = 2404  # 3+1 inputs -> width 16, one block (mlp_ratio 2), head to 3+1 outputs


def facts():
    return forecast.model_facts(CausalTransformer(3, 1, width=16, heads=2, layers=1))


def test_parameters_per_rank_follow_zero_and_the_tp_plan():
    f = facts()
    assert forecast.parameters_per_rank(f, Degrees("ddp", 2, 1, 1)) == PARAMS
    # FSDP2 pads dim 0 to a multiple of the ranks: the 4-row head weight and bias over 3 ranks hold 2 rows.
    assert forecast.parameters_per_rank(f, Degrees("fsdp2", 2, 1, 1)) == PARAMS // 2
    assert forecast.parameters_per_rank(f, Degrees("fsdp2", 3, 1, 1)) > PARAMS / 3
    # tp=2: q,k,v,mlp.0 (weight+bias) and out,mlp.2 (weight) halve; the rest (and row-wise biases) stays whole.
    split = 3 * (256 + 16) + (512 + 32) + 256 + 512
    assert forecast.parameters_per_rank(f, Degrees("none", 1, 2, 1)) == PARAMS - split // 2


def test_communication_of_each_layout():
    f = facts()
    ddp = forecast.predict_comm(f, Degrees("ddp", 2, 1, 1), 8, 16)
    assert ddp == {"all_reduce(gradients)": {"bytes": PARAMS * 4, "rounds": 1}}
    fsdp = forecast.predict_comm(f, Degrees("fsdp2", 2, 1, 1), 8, 16)
    # embed, blocks.0, norm, head: gathered in forward and again in backward, gradients scattered once.
    assert fsdp["all_gather(parameters)"] == {"bytes": 2 * PARAMS * 4, "rounds": 8}
    assert fsdp["reduce_scatter(gradients)"] == {"bytes": PARAMS * 4, "rounds": 4}
    tp = forecast.predict_comm(f, Degrees("none", 1, 2, 1), 8, 16)
    # Clipping makes each tp-sharded parameter's norm whole: q,k,v,mlp.0 (weight and bias), out and mlp.2 weights.
    assert tp == {"all_reduce(activations)": {"bytes": 6 * 8 * 16 * 16 * 4, "rounds": 6},
                  "all_reduce(gradient norm)": {"bytes": 10 * 4, "rounds": 10}}
    dp_tp = forecast.predict_comm(f, Degrees("fsdp2", 2, 2, 1), 8, 16)
    params = len(f.params)  # under FSDP2 every parameter's norm is also reduced over the dp ranks
    assert dp_tp["all_reduce(gradient norm)"] == {"bytes": (params + 10) * 4, "rounds": params + 10}
    assert "all_reduce(gradient norm)" not in ddp and "all_reduce(gradient norm)" not in fsdp
    cp = forecast.predict_comm(f, Degrees("ddp", 1, 1, 2), 8, 16)
    kv = 2 * 8 * 8 * 16 * 4
    assert cp["send(kv ring)"] == {"bytes": 3 * kv + kv, "rounds": 3}


def test_plan_refuses_with_the_layout_reason_and_ranks_within_budget():
    layouts = {"single": {"strategy": "none", "data_parallel": 1},
               "ddp": {"strategy": "ddp", "data_parallel": None},
               "fsdp2": {"strategy": "fsdp2", "data_parallel": None},
               "tp4": {"strategy": "none", "tensor_parallel": 4, "data_parallel": 1}}
    shapes = forecast.shard_shapes(CFG, layouts, 4)
    measured = {shape: (1000, 100) for shape in shapes}
    ranked = forecast.rank(forecast.plan(CFG, layouts, 4, facts(), measured), budget_bytes=30_000)
    by_name = {p.name: p for p in ranked}
    assert "mesh of 1 ranks" in by_name["single"].refused
    assert "must divide the model's 2 attention heads" in by_name["tp4"].refused
    assert "over the budget" in by_name["ddp"].refused  # 16 bytes per parameter: 38 KiB
    assert ranked[0].name == "fsdp2" and ranked[0].refused is None
    assert "fsdp2" in forecast.table(ranked) and "ruled out" in forecast.table(ranked)


def test_plan_command_ranks_the_conf_layouts_and_says_why_not(capsys):
    from worldpipe.cli import main

    assert main(["plan", "experiment=smoke_transformer", "world_size=4", "memory_mb=0.06"]) == 0
    out = capsys.readouterr().out
    ranked = [line.split()[1] for line in out.splitlines() if line[:2].strip().isdigit()]
    # Under 60 KiB per rank on 4 ranks: fsdp2, dp_tp (tp splits the activations too), and the layouts whose
    # activations recomputation shrinks (+rc).
    assert "fsdp2" in ranked and "ddp" not in ranked and "fsdp2+rc" in ranked and "dp_tp" in ranked
    assert all(name in ("fsdp2", "dp_tp") or name.endswith("+rc") for name in ranked), ranked
    for name in ("single", "tp", "cp"):  # meshes of 1 or 2 ranks: the layout check's reason, by key
        assert f"{name:8} ruled out: config key 'parallel.nproc_per_node'" in out
    assert "ddp      ruled out: needs" in out


def test_plan_command_sizes_a_pixel_model_by_its_frames(capsys):
    """A model that learns from frames observes H*W*3 values a step, not the env's state vector: the plan
    builds it at its image_size and measures it with its own noise (one draw per latent class)."""
    from worldpipe.cli import main

    small = ["model.image_size=16", "model.depth=2", "model.embed=8", "model.deter=8", "model.hidden=8"]
    assert main(["plan", "experiment=pendulum_pixels", "world_size=2", *small]) == 0
    out = capsys.readouterr().out
    ranked = [line.split()[1] for line in out.splitlines() if line[:2].strip().isdigit()]
    assert sorted(ranked) == ["ddp", "fsdp2"]  # batch-parallel only
    assert "tp       ruled out: config key 'parallel.tensor_parallel': model PixelRSSM has no tensor-parallel plan" in out


def test_plan_command_needs_a_world_size_one_line(capsys):
    from worldpipe.cli import main

    assert main(["plan", "experiment=smoke_transformer"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: argument 'world_size': required, a positive integer (world_size=4, or training's "
                   "parallel.nproc_per_node=4)"]


@pytest.mark.parametrize(("args", "world"), [
    (["world_size=4"], 4), (["parallel.nproc_per_node=4"], 4), (["parallel.nproc_per_node=2", "parallel.nnodes=2"], 4),
    (["world_size=4", "parallel.nproc_per_node=4"], 4),
])
def test_plan_takes_the_world_size_as_training_spells_it(args, world):
    """`worldpipe plan` accepts the training key (parallel.nproc_per_node, times parallel.nnodes) for world_size."""
    from worldpipe.commands.plan import _split

    assert _split([*args, "experiment=smoke", "memory_mb=8"]) == (world, 8.0, ["experiment=smoke"])


def test_plan_refuses_two_different_world_sizes_in_one_line(capsys):
    from worldpipe.cli import main

    assert main(["plan", "experiment=smoke_transformer", "world_size=4", "parallel.nproc_per_node=2"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: argument 'world_size': 4, but parallel.nproc_per_node x parallel.nnodes is 2: give one of them"]


def test_pipeline_sequence_parallel_and_recompute_predictions():
    """pp: the largest stage's tensors, rank 0's boundary sends (M calls) and its stage's gradient all_reduce;
    tp_sp: each region's all_reduce split into an all_gather and a reduce_scatter; recompute: its own forward."""
    model = CausalTransformer(3, 1, width=16, heads=2, layers=2)
    f = forecast.model_facts(model)
    stage_sizes = []
    for stage in range(2):
        cut = CausalTransformer(3, 1, width=16, heads=2, layers=2)
        cut.pipeline_stage(stage, 2)
        stage_sizes.append(sum(p.numel() for p in cut.parameters()))
    assert sum(stage_sizes) == sum(p.numel() for p in model.parameters())
    dp_pp = Degrees("ddp", 2, 1, 1, pp=2, microbatches=2, schedule="1f1b")
    assert forecast.parameters_per_rank(f, dp_pp) == max(stage_sizes)
    comm = forecast.predict_comm(f, dp_pp, 8, 16)
    assert comm["send(stage activations)"] == {"bytes": 4 * 16 * 16 * 4, "rounds": 2}  # 4 windows × 16 steps × 16
    assert comm["all_reduce(stage gradients)"] == {"bytes": stage_sizes[0] * 4, "rounds": 1}
    tp_sp = forecast.predict_comm(f, Degrees("none", 1, 2, 1, sp=True), 8, 16)
    full = 8 * 16 * 16 * 4  # regions: attention and MLP of 2 blocks; all_gather hands in the half
    assert tp_sp == {"all_gather(activations)": {"bytes": 10 * full // 2, "rounds": 10},
                     "reduce_scatter(activations)": {"bytes": 4 * full, "rounds": 4},
                     "all_reduce(activations)": {"bytes": 8 * full, "rounds": 8},
                     "all_reduce(gradient norm)": {"bytes": 20 * 4, "rounds": 20}}
    cfg = {**CFG, "model": {**CFG["model"], "layers": 2}}
    layouts = {"pp": {"strategy": "none", "pipeline_parallel": 2, "microbatches": 4, "data_parallel": 1},
               "pp+rc": {"strategy": "none", "pipeline_parallel": 2, "microbatches": 4, "data_parallel": 1,
                         "recompute": True}}
    shapes = forecast.shard_shapes(cfg, layouts, 2)
    # The largest stage's forward is measured, the whole window's rollout state too.
    whole, stages = ForwardShape(8, 16), ForwardShape(8, 16, stages=2)
    recomputed = ForwardShape(8, 16, stages=2, recompute=True)
    assert shapes == {whole, stages, recomputed}
    measured = {whole: (5000, 10), stages: (1000, 10), recomputed: (200, 10)}
    by_name = {p.name: p for p in forecast.plan(cfg, layouts, 2, f, measured)}
    assert by_name["pp"].memory["activations"] == 1000 and by_name["pp+rc"].memory["activations"] == 200  # GPipe
    one_f_one_b = forecast.pipeline_activations(1000, Degrees("none", 1, 1, 1, pp=2, microbatches=8, schedule="1f1b"))
    assert one_f_one_b == 250  # at most P=2 of the 8 microbatches alive on a stage


def test_forwards_are_measured_as_one_rank_of_the_layout_holds_them():
    """A tensor-parallel shard (over the fake process group, in this process) saves less than the whole model,
    sequence parallelism less again; the largest pipeline stage less than the whole; recomputation least."""
    model = CausalTransformer(3, 1, width=16, heads=2, layers=2)
    shapes = [ForwardShape(4, 16), ForwardShape(4, 16, tp=2), ForwardShape(4, 16, tp=2, sp=True),
              ForwardShape(4, 16, stages=2), ForwardShape(4, 16, recompute=True)]
    held = {shape: bytes_ for shape, (bytes_, _) in measure_forwards(model, shapes, 3, 1).items()}
    whole, tp, sp, stage, recomputed = (held[shape] for shape in shapes)
    assert sp < tp < whole and stage < whole and recomputed < stage, held
    assert not __import__("torch").distributed.is_initialized()  # the fake group is gone again
