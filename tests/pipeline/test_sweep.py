"""Sweep declarations expand into named points with Hydra overrides; bad declarations name the key."""

from pathlib import Path

import pytest
import yaml

from worldpipe.pipeline.sweep import SweepError, expand_sweep, short_value, swept_keys

REPO = Path(__file__).resolve().parents[2]


def test_grid_is_the_cartesian_product_in_declaration_order():
    points = expand_sweep({"name": "s", "experiment": "smoke", "grid": {"trainer.lr": [1e-3, 3e-3],
                                                                        "model.stoch": [4, 8]}})
    assert [p.overrides for p in points] == [
        ["trainer.lr=0.001", "model.stoch=4"], ["trainer.lr=0.001", "model.stoch=8"],
        ["trainer.lr=0.003", "model.stoch=4"], ["trainer.lr=0.003", "model.stoch=8"]]
    assert points[0].name == "trainer.lr-0.001__model.stoch-4"
    assert all("," not in p.name and "=" not in p.name and "/" not in p.name for p in points)


def test_seeds_multiply_points_and_come_last_among_swept_keys():
    sweep = {"name": "s", "experiment": "smoke", "grid": {"model.stoch": [4, 8]}, "seeds": [0, 1, 2]}
    points = expand_sweep(sweep)
    assert len(points) == 6
    assert points[1].as_dict() == {"model.stoch": 4, "seed": 1}
    assert swept_keys(sweep) == ["model.stoch", "seed"]


def test_adding_a_value_keeps_the_names_of_existing_points():
    small = {p.name for p in expand_sweep({"grid": {"trainer.lr": [1e-3], "model.stoch": [4, 8]}})}
    large = {p.name for p in expand_sweep({"grid": {"trainer.lr": [1e-3, 1e-2], "model.stoch": [4, 8]}})}
    assert small < large


def test_listed_points_and_only_varying_keys_are_swept():
    sweep = {"points": [{"trainer.lr": 1e-3, "model.stoch": 4}, {"trainer.lr": 1e-3, "model.stoch": 8}]}
    assert [p.overrides for p in expand_sweep(sweep)] == [["trainer.lr=0.001", "model.stoch=4"],
                                                         ["trainer.lr=0.001", "model.stoch=8"]]
    assert swept_keys(sweep) == ["model.stoch"]


@pytest.mark.parametrize(("sweep", "message"), [
    ({"grid": {"trainer.lr": []}}, "'sweep.grid.trainer.lr'"),
    ({"grid": {"trainer lr": [1]}}, "'sweep.grid.trainer lr'"),
    ({"grid": {"run_dir": ["x"]}}, "'sweep.grid.run_dir'"),
    ({"grid": {"a": [1]}, "points": [{"a": 1}]}, "exactly one of"),
    ({"points": [{}]}, "'sweep.points[0]'"),
    ({"points": [{"a": 1}, {"a": 1}]}, "more than once"),
    ({"grid": {"seed": [1]}, "seeds": [0]}, "'sweep.seeds'"),
    ({"grid": {"a": [1]}, "seeds": [-1]}, "'sweep.seeds'"),
    ({"grid": {"model.name": ["a b"]}}, "'a b'"),
])
def test_bad_declarations_name_the_key(sweep, message):
    with pytest.raises(SweepError, match=message.replace("[", r"\[").replace("]", r"\]")):
        expand_sweep(sweep)


def test_the_smoke_sweep_config_is_a_2x2_sweep():
    config = yaml.safe_load((REPO / "conf/pipeline/sweep_smoke.yaml").read_text())
    assert len(expand_sweep(config["sweep"])) == 4
    assert swept_keys(config["sweep"]) == ["trainer.lr", "model.stoch"]


def test_a_points_run_name_states_its_values_in_short_form():
    lr_bs, shared = expand_sweep({"grid": {"trainer.lr": [3e-4], "data.batch_size": [32], "seed": [0]}}) + \
        expand_sweep({"points": [{"trainer.lr": 0.5, "model.lr": 1.5e-5, "model.act": "silu"}]})
    assert lr_bs.label == "lr=3e-4,batch_size=32,seed=0"
    assert shared.label == "trainer.lr=0.5,model.lr=1.5e-5,act=silu"  # two keys end in 'lr': both in full
    assert lr_bs.label_override == "tracking.run_name='lr=3e-4,batch_size=32,seed=0'"
    assert [short_value(v) for v in (1e-3, 0.01, 100.0, 0.123456, 8, True)] == [
        "1e-3", "0.01", "100.0", "0.123456", "8", "true"]
