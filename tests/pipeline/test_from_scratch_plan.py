"""The loop from scratch in the plan (conf/pipeline/from_scratch.yaml): a budget of real env steps sets the round
count, a warm start names the previous round's run in each round's identity, and whole loops with other seeds share
nothing but the held-out evaluation."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from worldpipe.data.spec import spec_hash
from worldpipe.pipeline.plan import Dataset, PipelineError, plan
from worldpipe.pipeline.rounds import LOOP_SEED_STRIDE, loops_id, plan_loops, round_count, rounds_id

REPO = Path(__file__).resolve().parents[2]
CONF = REPO / "conf"


def scratch_config(**rounds) -> dict:
    config = yaml.safe_load((REPO / "conf/pipeline/default.yaml").read_text())
    config.update(yaml.safe_load((REPO / "conf/pipeline/from_scratch.yaml").read_text()))
    config["rounds"].update(rounds)
    return config


def base(episodes: int = 2, max_steps: int = 200) -> Dataset:
    spec = {"name": "pendulum_random", "env_id": "Pendulum-v1", "policy": "random", "episodes": episodes,
            "max_steps": max_steps, "episodes_per_shard": 2, "seed": 0}
    return Dataset("pendulum_random", spec, spec_hash(spec))


@pytest.mark.parametrize(("budget", "count"), [(400, 0), (799, 0), (800, 1), (2000, 4), (2199, 4)])
def test_a_budget_of_real_steps_holds_as_many_rounds_as_fit(budget, count):
    assert round_count({"budget_steps": budget, "episodes": 2}, base()) == count


@pytest.mark.parametrize(("rounds", "needle"), [
    ({"episodes": 2}, "rounds: give either `count` (collection rounds after round 0) or `budget_steps`"),
    ({"episodes": 2, "count": 1, "budget_steps": 900}, "not both"),
    ({"episodes": 2, "budget_steps": 300}, "rounds.budget_steps: 300 is less than round 0's 400 steps"),
])
def test_a_budget_that_cannot_work_is_one_line(rounds, needle):
    with pytest.raises(PipelineError) as err:
        round_count(rounds, base())
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_loops_warm_start_from_the_previous_round_and_differ_only_in_their_seeds():
    config = scratch_config(loop_seeds=[0, 3], budget_steps=1200, episodes=2)
    known, _ = plan(config, CONF)
    loops = plan_loops(config, known, CONF)
    assert [len(found) for found in loops] == [3, 3]  # 400 random steps, then two rounds of 400
    first, other = loops
    assert first[0].dataset.name == "pendulum_random" and first[0].dataset.spec["policy"] == "random"
    assert other[0].dataset.name == "pendulum_random-loop3" and other[0].dataset.spec["seed"] == 3
    assert "seed=3" in other[0].run.overrides and not any(o.startswith("seed=") for o in first[0].run.overrides)
    for found, loop_seed in ((first, 0), (other, 3)):
        assert not any(o.startswith("+init_from") for o in found[0].run.overrides)
        for previous, current in zip(found, found[1:], strict=False):
            assert f"+init_from=pendulum_scratch/{previous.run.run_hash}" in current.run.overrides
            assert current.dataset.spec["seed"] == 7000 + current.index + LOOP_SEED_STRIDE * loop_seed
            assert current.dataset.name == f"{found[0].dataset.name}-round{current.index}"
    # every loop and round is judged on the same held-out episodes and closed-loop seeds
    runs = [r.run for found in loops for r in found]
    assert {r.heldout.name for r in runs} == {"pendulum_random-heldout"}
    assert len({r.control_hash for r in runs}) == 1 and len({r.run_hash for r in runs}) == 6
    assert rounds_id(first) != rounds_id(other) and loops_id(loops).startswith("loops-")


def test_the_warm_start_is_part_of_every_later_rounds_identity():
    warm = plan_loops(scratch_config(loop_seeds=[0], budget_steps=800), plan(scratch_config(), CONF)[0], CONF)[0]
    config = scratch_config(loop_seeds=[0], budget_steps=800, warm_start=False)
    cold = plan_loops(config, plan(config, CONF)[0], CONF)[0]
    assert warm[0].run == cold[0].run
    assert warm[1].run.run_hash != cold[1].run.run_hash
    assert warm[1].dataset.spec_hash == cold[1].dataset.spec_hash  # the same data: collected by the same round 0


def test_a_loop_seed_named_twice_is_one_line():
    config = scratch_config(loop_seeds=[1, 1])
    with pytest.raises(PipelineError, match=r"rounds.loop_seeds: \[1, 1\] names a loop twice"):
        plan_loops(config, plan(config, CONF)[0], CONF)
