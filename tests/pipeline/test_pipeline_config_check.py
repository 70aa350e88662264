"""Issue 51: a pipeline config that breaks its JSON schema is one line naming the key path, what is wrong and the
valid range, values or keys (worldpipe.pipeline.config_check), for every kind of violation the schema has."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from worldpipe.pipeline.config_check import schema_problem

REPO = Path(__file__).resolve().parents[2]
SCHEMA = REPO / "workflow" / "schemas" / "config.schema.yaml"


def rounds_config(**changes) -> dict:
    """conf/pipeline/rounds.yaml over default.yaml (as Snakemake merges them), ``rounds`` changed."""
    config = yaml.safe_load((REPO / "conf/pipeline/default.yaml").read_text())
    config.update(yaml.safe_load((REPO / "conf/pipeline/rounds.yaml").read_text()))
    config["rounds"] = {**config["rounds"], **changes}
    return {**config, "rounds": {k: v for k, v in config["rounds"].items() if v is not None}}


KEYS = ("required: experiment, episodes, seed, context, planner; optional: count, budget_steps, warm_start, "
        "loop_seeds, exploration_std, novelty_bonus, novelty_reference, planner_overrides, train_on")


@pytest.mark.parametrize(("changes", "line"), [
    ({"count": -1}, "rounds.count: -1 is out of range (valid: >= 0)"),
    ({"episodes": 0}, "rounds.episodes: 0 is out of range (valid: >= 1)"),
    ({"seed": None}, f"rounds: missing key 'seed' ({KEYS})"),
    ({"extra": 1}, f"rounds: unknown key 'extra' ({KEYS})"),
    ({"train_on": "all"}, "rounds.train_on: 'all' is not one of union, latest"),
    ({"count": "two"}, "rounds.count: 'two' is not of type integer >= 0"),
    ({"experiment": "no such"}, "rounds.experiment: 'no such' does not match '^[A-Za-z0-9_.-]+$'"),
])
def test_a_rounds_violation_is_one_line_naming_the_key(changes, line):
    assert schema_problem(rounds_config(**changes), SCHEMA) == line


# A shipped overlay of another shipped config (given after it: `--configfile from_scratch.yaml one_loop.yaml`).
OVERLAY_OF = {"one_loop.yaml": "from_scratch.yaml"}


def test_the_shipped_configs_conform():
    from snakemake.utils import update_config

    def merged(name: str) -> dict:
        config = yaml.safe_load((REPO / "conf/pipeline/default.yaml").read_text())  # the Snakefile's `configfile`
        for layer in (OVERLAY_OF.get(name), name):
            if layer:
                update_config(config, yaml.safe_load((REPO / "conf/pipeline" / layer).read_text()))  # key by key
        return config

    for path in sorted((REPO / "conf/pipeline").glob("*.yaml")):
        assert schema_problem(merged(path.name), SCHEMA) is None, path.name


def test_the_main_config_is_reported_the_same_way():
    config = yaml.safe_load((REPO / "conf/pipeline/smoke.yaml").read_text())
    config["train"]["nproc_per_node"] = -1
    assert schema_problem(config, SCHEMA) == "train.nproc_per_node: -1 is out of range (valid: >= 1)"
