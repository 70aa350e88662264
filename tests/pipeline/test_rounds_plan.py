"""Collection rounds in the plan: each round's dataset names the run that collects it, every hash follows from the
config, a raised round count leaves the earlier rounds as they were, and a loop that cannot run is one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from worldpipe.data.spec import DatasetSpec, spec_hash
from worldpipe.pipeline.plan import PipelineError, plan
from worldpipe.pipeline.rounds import plan_rounds

REPO = Path(__file__).resolve().parents[2]
CONF = REPO / "conf"


def rounds_config(**rounds) -> dict:
    config = yaml.safe_load((REPO / "conf/pipeline/default.yaml").read_text())
    config.update(yaml.safe_load((REPO / "conf/pipeline/rounds.yaml").read_text()))
    config["rounds"].update(rounds)
    return config


def planned(config: dict):
    known, _ = plan(config, CONF)
    return plan_rounds(config, known, CONF), known


@pytest.mark.slow  # composes a Hydra config per round (seconds each)
def test_each_round_collects_with_the_previous_rounds_run_and_trains_on_the_union():
    found, known = planned(rounds_config(count=2))
    assert [r.index for r in found] == [0, 1, 2]
    assert found[0].dataset.name == "pendulum" and found[0].run.experiment == "pendulum_rssm"
    for previous, current in zip(found, found[1:], strict=False):
        collector = current.dataset.spec["collector"]
        assert current.dataset.name == f"pendulum-round{current.index}" and collector["round"] == current.index
        assert collector["run_hash"] == previous.run.run_hash and collector["experiment"] == "pendulum_rssm"
        assert collector["parent"] == {"name": previous.dataset.name, "spec_hash": previous.dataset.spec_hash}
        assert collector["copied_episodes"] == previous.dataset.spec["episodes"]
        assert current.dataset.spec["episodes"] == previous.dataset.spec["episodes"] + 64
        assert current.dataset.spec["seed"] == 7000 + current.index
        assert collector["planner"]["_target_"] == "worldpipe.control.planners.MPPI"
        assert known[current.dataset.name] == current.dataset
    runs = [r.run for r in found]
    assert len({r.run_hash for r in runs}) == 3
    # every round is judged on round 0's held-out episodes and the same closed-loop seeds
    assert {r.heldout.name for r in runs} == {"pendulum-heldout"}
    assert len({r.control_hash for r in runs}) == 1 and len({r.eval_hash for r in runs}) == 1


@pytest.mark.slow  # composes a Hydra config per round (seconds each)
def test_round_zero_is_the_default_pipelines_run():
    found, _ = planned(rounds_config())
    _, runs = plan(yaml.safe_load((REPO / "conf/pipeline/default.yaml").read_text()), CONF)
    assert found[0].run == runs["pendulum_rssm"]


@pytest.mark.slow  # composes a Hydra config per round (seconds each)
def test_a_raised_round_count_keeps_every_earlier_round():
    two, _ = planned(rounds_config(count=2))
    three, _ = planned(rounds_config(count=3))
    assert [r.run.run_hash for r in three[:3]] == [r.run.run_hash for r in two]
    assert [r.dataset.spec_hash for r in three[:3]] == [r.dataset.spec_hash for r in two]


@pytest.mark.slow  # composes a Hydra config per round (seconds each)
def test_a_changed_collection_setting_changes_that_round_and_every_later_one():
    base, _ = planned(rounds_config(count=2))
    noisier, _ = planned(rounds_config(count=2, exploration_std=0.3))
    assert base[0].run == noisier[0].run
    assert all(a.dataset.spec_hash != b.dataset.spec_hash and a.run.run_hash != b.run.run_hash
               for a, b in zip(base[1:], noisier[1:], strict=True))


@pytest.mark.slow  # composes a Hydra config per round (seconds each)
def test_latest_trains_on_the_rounds_own_episodes():
    found, _ = planned(rounds_config(count=1, train_on="latest"))
    spec = found[1].dataset.spec
    assert spec["collector"]["copied_episodes"] == 0 and spec["episodes"] == 64


COMPOSES = pytest.mark.slow  # the refusal comes after round 0's config is composed (seconds)


@pytest.mark.parametrize(("change", "needle"), [
    (lambda c: c.pop("control"), "rounds: needs the pipeline config's `control:` section"),
    pytest.param(lambda c: c["rounds"].update(planner="nope"), "rounds.planner: no planner 'nope' in", marks=COMPOSES),
    pytest.param(lambda c: c["rounds"].update(planner_overrides=["horizn=3"]), "rounds.planner_overrides: planner override 'horizn=3'",
                 marks=COMPOSES),
    pytest.param(lambda c: c["datasets"]["pendulum"].update(pixels=True), "collection rounds plan in "
                 "continuous-action envs from state observations", marks=COMPOSES),
])
def test_a_loop_that_cannot_run_is_one_line_naming_the_key(change, needle):
    config = rounds_config()
    change(config)
    with pytest.raises(PipelineError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        planned(config)


def test_a_scripted_policys_spec_has_no_collector_and_keeps_its_hash():
    raw = {"name": "pendulum", "env_id": "Pendulum-v1", "policy": "noisy_controller", "episodes": 8, "max_steps": 20,
           "episodes_per_shard": 4, "seed": 0}
    spec = DatasetSpec.from_dict(raw).to_dict()
    assert "collector" not in spec
    assert spec_hash(raw) == spec_hash({**raw, "collector": None}) == spec_hash(spec)


@pytest.mark.slow  # composes a Hydra config per round (seconds each)
def test_a_collector_block_is_checked_key_by_key():
    found, _ = planned(rounds_config(count=1))
    spec = dict(found[1].dataset.spec)
    with pytest.raises(ValueError, match="must have the keys"):
        DatasetSpec.from_dict({**spec, "collector": {**spec["collector"], "extra": 1}})
    with pytest.raises(ValueError, match="collector.context' has the wrong type"):
        DatasetSpec.from_dict({**spec, "collector": {**spec["collector"], "context": "8"}})
    with pytest.raises(ValueError, match="copied_episodes' must be in"):
        DatasetSpec.from_dict({**spec, "collector": {**spec["collector"], "copied_episodes": spec["episodes"]}})
    with pytest.raises(ValueError, match="act on state observations"):
        DatasetSpec.from_dict({**spec, "pixels": True})
