"""Issue 51: a bad `rounds:` section stops `snakemake` while the Snakefile is parsed, with one line that names the
key path, what is wrong and the valid range or keys, exit status 2, and no job planned: real `snakemake -n` runs
of conf/pipeline/rounds.yaml with one key changed (every kind of violation: tests/pipeline/test_pipeline_config_check.py).
"""

from __future__ import annotations

import pytest
import yaml

from pipeline_project import dry_run

pytestmark = [pytest.mark.adversarial, pytest.mark.integration]

CASES = {
    "negative count": ({"count": -1}, "error: pipeline config: rounds.count: -1 is out of range (valid: >= 0)"),
    "missing key": ({"seed": None}, "error: pipeline config: rounds: missing key 'seed' (required: experiment, "
                                    "episodes, seed, context, planner; optional: count, budget_steps, warm_start, "
                                    "loop_seeds, exploration_std, novelty_bonus, novelty_reference, planner_overrides, "
                                    "train_on)"),
    "unknown experiment": ({"experiment": "nosuch"}, "error: pipeline config: rounds.experiment: experiment "
                                                     "'nosuch' does not compose"),
}
# The top-level `value:` the rounds' planners use: the schema admits every method's settings, the method's own
# check refuses those of the other one.
VALUE_CASES = {
    "other method's setting": ({"method": "actor_critic", "iterations": 3},
                               "error: pipeline config: value: 'iterations' is not a setting of method 'actor_critic'"),
    "unknown method": ({"method": "critic"}, "error: pipeline config: value.method: 'critic' is not one of"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_bad_rounds_section_is_one_line_at_parse_time(case, repo, tmp_path, env_with_venv):
    changes, start = CASES[case]
    config = yaml.safe_load((repo / "conf/pipeline/rounds.yaml").read_text())
    config["rounds"] = {k: v for k, v in {**config["rounds"], **changes}.items() if v is not None}
    proc = dry_run(repo, tmp_path / "wd", env_with_venv, config)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith(start), proc.stdout + proc.stderr
    for noise in ("Traceback", "ValidationError", "WorkflowError", 'File "', "experiments:"):
        assert noise not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "wd" / "results").exists()


@pytest.mark.parametrize("case", sorted(VALUE_CASES))
def test_a_bad_value_section_is_one_line_at_parse_time(case, repo, tmp_path, env_with_venv):
    block, start = VALUE_CASES[case]
    config = yaml.safe_load((repo / "conf/pipeline/rounds.yaml").read_text())
    config["value"] = block
    proc = dry_run(repo, tmp_path / "wd", env_with_venv, config)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith(start), proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert not (tmp_path / "wd" / "results").exists()
