"""A DeepMind Control dataset that cannot be collected stops `snakemake` while the Snakefile is parsed, in one line
naming the key: an unknown task (the config's schema), an observation key the task does not have, or none given
(checked against the task's own observation). Real `snakemake -n` runs of conf/pipeline/dmc_cartpole.yaml."""

from __future__ import annotations

import pytest
import yaml

from pipeline_project import dry_run

pytestmark = [pytest.mark.adversarial, pytest.mark.integration]

CASES = {
    "unknown task": ({"env_id": "dm_control/cartpole-swingupp-v0"},
                     "error: pipeline config: datasets.cartpole_swingup.env_id: 'dm_control/cartpole-swingupp-v0'"),
    "missing key": ({"observation_keys": ["position", "speed"]},
                    "error: pipeline config: datasets: cartpole_swingup: dataset spec key 'observation_keys': "
                    "dm_control/cartpole-swingup-v0 has no observation 'speed' (its keys: position, velocity)"),
    "no key order": ({"observation_keys": None},
                     "error: pipeline config: datasets: cartpole_swingup: dataset spec key 'observation_keys' is "
                     "required for dm_control/cartpole-swingup-v0 (a dict observation)"),
}


@pytest.mark.parametrize("case", [pytest.param(case, marks=pytest.mark.slow) if case == "no key order" else case
                                  for case in sorted(CASES)])  # the third: another parse of the same kind
def test_a_dmc_dataset_that_cannot_be_collected_is_one_line_at_parse_time(case, repo, tmp_path, env_with_venv):
    changes, start = CASES[case]
    config = yaml.safe_load((repo / "conf/pipeline/dmc_cartpole.yaml").read_text())
    entry = config["datasets"]["cartpole_swingup"]
    config["datasets"]["cartpole_swingup"] = {k: v for k, v in {**entry, **changes}.items() if v is not None}
    proc = dry_run(repo, tmp_path / "wd", env_with_venv, config)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith(start), proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert not (tmp_path / "wd" / "results").exists()
