"""The pipeline's plan: run and dataset identities from the composed Hydra config and the dataset specs."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from worldpipe.config import paths
from worldpipe.pipeline.plan import PipelineError, plan, training_settings

REPO = Path(__file__).resolve().parents[2]


def pipeline_config(experiments=("pendulum_rssm",), overrides=()) -> dict:
    config = yaml.safe_load((REPO / "conf/pipeline/default.yaml").read_text())
    config["experiments"] = list(experiments)
    config["train"]["overrides"] = list(overrides)
    return config


@pytest.fixture
def conf(tmp_path) -> Path:
    """A copy of conf/ to edit."""
    shutil.copytree(REPO / "conf", tmp_path / "conf")
    return tmp_path / "conf"


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))


def run_hashes(config: dict, conf: Path) -> dict[str, str]:
    return {name: run.run_hash for name, run in plan(config, conf)[1].items()}


def test_an_edit_in_conf_changes_the_run_hash_and_restoring_it_restores_the_hash(conf):
    config = pipeline_config()
    before = run_hashes(config, conf)
    edit(conf / "trainer/default.yaml", "lr: 1.0e-3", "lr: 3.0e-4")
    changed = run_hashes(config, conf)
    edit(conf / "trainer/default.yaml", "lr: 3.0e-4", "lr: 1.0e-3")
    assert changed["pendulum_rssm"] != before["pendulum_rssm"]
    assert run_hashes(config, conf) == before


def control_hashes(config: dict, conf: Path) -> dict[str, str | None]:
    return {name: run.control_hash for name, run in plan(config, conf)[1].items()}


def test_an_edit_of_the_planners_config_is_a_new_closed_loop_evaluation_not_a_new_run(conf):
    config = pipeline_config()
    runs, controls = run_hashes(config, conf), control_hashes(config, conf)
    edit(conf / "planner/mppi.yaml", "samples: 128", "samples: 64")
    assert run_hashes(config, conf) == runs
    assert control_hashes(config, conf)["pendulum_rssm"] not in (None, controls["pendulum_rssm"])
    edit(conf / "planner/mppi.yaml", "samples: 64", "samples: 128")
    assert control_hashes(config, conf) == controls
    config["control"]["planner"] = "nope"
    with pytest.raises(PipelineError, match=r"control: planner: 'nope': cannot read .*nope\.yaml .*planners: cem, mppi"):
        plan(config, conf)


def test_an_override_changes_the_hash_a_resume_safe_key_does_not(conf):
    base = run_hashes(pipeline_config(), conf)
    assert run_hashes(pipeline_config(overrides=["trainer.lr=3e-4"]), conf) != base
    assert run_hashes(pipeline_config(overrides=["trainer.log_every=7"]), conf) == base
    edit(conf / "trainer/default.yaml", "log_every: 10", "log_every: 20")
    assert run_hashes(pipeline_config(), conf) == base


def test_a_layout_override_is_a_resume_safe_setting_not_part_of_the_run():
    # `parallel=<layout>` selects a whole group of resume-safe keys: the jobs get it with the settings (outside
    # the rule's parameters, so switching it does not make Snakemake rerun a finished run), never in the
    # overrides that name the run.
    config = pipeline_config(overrides=["parallel=fsdp2", "trainer.lr=3e-4"])
    (run,) = plan(config)[1].values()
    assert "parallel=fsdp2" not in run.overrides and "trainer.lr=3e-4" in run.overrides
    assert "parallel=fsdp2" in training_settings(config, "")
    assert run.run_hash == plan(pipeline_config(overrides=["trainer.lr=3e-4"]))[1]["pendulum_rssm"].run_hash


def test_only_the_experiments_an_edit_touches_change(conf):
    config = pipeline_config(["pendulum_rssm", "cartpole_rssm"])
    config["datasets"]["cartpole"] = dict(config["datasets"]["pendulum"], env_id="CartPole-v1", policy="random")
    before = run_hashes(config, conf)
    edit(conf / "data/cartpole.yaml", "window: 32", "window: 24")
    after = run_hashes(config, conf)
    assert after["pendulum_rssm"] == before["pendulum_rssm"]
    assert after["cartpole_rssm"] != before["cartpole_rssm"]


def test_each_experiment_gets_the_dataset_its_config_names(conf):
    config = pipeline_config(["pendulum_rssm", "cartpole_rssm"])
    config["datasets"]["cartpole"] = dict(config["datasets"]["pendulum"], env_id="CartPole-v1", policy="random")
    datasets, runs = plan(config, conf)
    assert runs["pendulum_rssm"].dataset.name == "pendulum"
    assert runs["cartpole_rssm"].dataset.name == "cartpole"
    assert runs["cartpole_rssm"].heldout.name == "cartpole-heldout"
    assert runs["cartpole_rssm"].dataset.spec["env_id"] == "CartPole-v1"
    assert len({d.dir for d in datasets.values()}) == 4
    assert runs["cartpole_rssm"].dir == f"results/runs/cartpole_rssm/{paths.short(runs['cartpole_rssm'].run_hash)}"


def test_an_undeclared_dataset_is_one_error_naming_experiment_and_dataset(conf):
    with pytest.raises(PipelineError, match=r"'cartpole_rssm' trains on data.name='cartpole'.*declared: \['pendulum'\]"):
        plan(pipeline_config(["pendulum_rssm", "cartpole_rssm"]), conf)
    with pytest.raises(PipelineError, match="'no_such_experiment' does not compose"):
        plan(pipeline_config(["no_such_experiment"]), conf)


def test_a_changed_dataset_spec_is_a_new_dataset_and_a_new_run(conf):
    config = pipeline_config()
    datasets, runs = plan(config, conf)
    config["datasets"]["pendulum"]["seed"] = 7
    datasets2, runs2 = plan(config, conf)
    assert datasets2["pendulum"].dir != datasets["pendulum"].dir
    assert runs2["pendulum_rssm"].run_hash != runs["pendulum_rssm"].run_hash
    assert runs2["pendulum_rssm"].config_hash == runs["pendulum_rssm"].config_hash
    # A held-out change re-evaluates; the training data and so the run stay the same.
    config["datasets"]["pendulum"]["seed"] = 0
    config["datasets"]["pendulum"]["heldout"]["seed"] = 2000
    datasets3, runs3 = plan(config, conf)
    assert datasets3["pendulum-heldout"].dir != datasets["pendulum-heldout"].dir
    assert runs3["pendulum_rssm"].run_hash == runs["pendulum_rssm"].run_hash


def test_a_default_written_out_or_left_out_is_the_same_dataset(conf):
    config = pipeline_config()
    spelled = plan(config, conf)[0]["pendulum"]
    for key in ("pixels", "pixel_size", "compressor"):
        del config["datasets"]["pendulum"][key]
    assert plan(config, conf)[0]["pendulum"].spec_hash == spelled.spec_hash


def test_a_direct_training_finds_its_dataset_by_the_spec_of_the_pipeline_that_trains_it(conf, tmp_path,
                                                                                      monkeypatch):
    from worldpipe.pipeline.plan import datasets, locate_dataset

    monkeypatch.chdir(tmp_path)
    smoke = datasets(yaml.safe_load((conf / "pipeline/smoke.yaml").read_text()))["pendulum"]
    default = datasets(yaml.safe_load((conf / "pipeline/default.yaml").read_text()))["pendulum"]
    assert smoke.dir != default.dir
    with pytest.raises(PipelineError, match=r"'data.manifest': dataset 'pendulum' \(spec of .*smoke.yaml\) is not "
                                            r"built .*snakemake --cores 2 --configfile .*smoke.yaml --until seal"):
        locate_dataset("pendulum", "smoke", conf)
    for dataset in (smoke, default):
        Path(dataset.dir).mkdir(parents=True)
        (Path(dataset.dir) / paths.MANIFEST_NAME).write_text("{}")
    assert locate_dataset("pendulum", "smoke", conf) == smoke          # the pipeline that trains `smoke`
    assert locate_dataset("pendulum", "pendulum_gru", conf) == default  # default.yaml trains it
    assert locate_dataset("pendulum", None, conf) == default           # else default.yaml first
    with pytest.raises(PipelineError, match=r"'data.name': dataset 'cartpole' is declared in no conf/pipeline"):
        locate_dataset("cartpole", "cartpole_rssm", conf)
