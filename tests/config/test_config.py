"""Config composition and validation: every experiment composes; bad values fail early, naming the key."""

from pathlib import Path

import pytest

from worldpipe.config.compose import compose_config, with_values
from worldpipe.config.identity import (
    ConfigError,
    config_diff,
    config_hash,
    flatten,
    identity_config,
    to_container,
)
from worldpipe.config.paths import CONF_DIR
from worldpipe.launch.launcher import torchrun_command
from worldpipe.trainer.validation import validate_config

EXPERIMENTS = sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_composes_and_validates(experiment):
    cfg = compose_config([f"experiment={experiment}"])
    assert cfg.experiment_name == experiment
    validate_config(cfg, world_size=cfg.parallel.nproc_per_node)


def test_experiments_exist():
    assert {"pendulum_rssm", "smoke", "cartpole_rssm", "pendulum_fsdp2"} <= set(EXPERIMENTS)


def test_unknown_group_option_is_rejected():
    with pytest.raises(ConfigError, match="config group 'model': no option 'transformerx'"):
        compose_config(["model=transformerx"])


def test_unknown_key_is_rejected():
    with pytest.raises(ConfigError, match="config key 'trainer.lr_typo': not a key of the trainer group"):
        compose_config(["trainer.lr_typo=0.1"])


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("trainer.lr=0", "trainer.lr"),
        ("trainer.lr=-1e-3", "trainer.lr"),
        ("trainer.batch_size=0", "trainer.batch_size"),
        ("trainer.batch_size=-4", "trainer.batch_size"),
        ("trainer.batch_size=15", "trainer.batch_size"),  # not divisible by 2 ranks
        ("trainer.steps=0", "trainer.steps"),
        ("checkpoint.keep_last=1", "checkpoint.keep_last"),
        ("parallel.strategy=zero9", "parallel.strategy"),
        ("data.window=1", "data.window"),
    ],
)
def test_bad_values_name_the_key(override, key):
    cfg = compose_config([override])
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate_config(cfg, world_size=2)


def test_uneven_batches_allowed_when_asked():
    cfg = compose_config(["trainer.batch_size=15", "parallel.even_batches=false"])
    validate_config(cfg, world_size=2)


def test_hash_ignores_resume_safe_keys_only():
    base = compose_config([])
    assert config_hash(base) == config_hash(compose_config(["trainer.steps=99", "checkpoint.every=7"]))
    assert config_hash(base) != config_hash(compose_config(["trainer.lr=0.5"]))
    diff = config_diff(identity_config(base), identity_config(compose_config(["trainer.lr=0.5"])))
    assert diff == ["  trainer.lr: 0.001 -> 0.5"]


def test_flatten_is_dotted_and_complete():
    flat = flatten({"a": {"b": 1, "c": {"d": [1, 2]}}, "e": None})
    assert flat == {"a.b": 1, "a.c.d": [1, 2], "e": None}


def test_torchrun_workers_load_the_recorded_config():
    cfg = compose_config(["experiment=smoke", "run_dir=/tmp/x"])
    cmd = torchrun_command(cfg, Path("/tmp/x/hydra/config.yaml"))
    assert "--nproc-per-node=2" in cmd and "--rdzv-backend=c10d" in cmd and "--standalone" not in cmd
    assert any(arg.startswith("--rdzv-endpoint=127.0.0.1:") for arg in cmd)
    assert cmd[-3:] == ["-m", "worldpipe.launch.worker", "--config=/tmp/x/hydra/config.yaml"]


def test_cli_rejects_bad_config_before_work(tmp_path: Path, capsys):
    from worldpipe.cli import main

    code = main(["train", "trainer.lr=-1", f"run_dir={tmp_path / 'run'}"])
    assert code == 2
    assert "trainer.lr" in capsys.readouterr().err
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize(
    ("override", "key"),
    [("trainer.lr=abc", "trainer.lr"), ("trainer.steps=1.5", "trainer.steps"), ("data.window=x", "data.window"),
     ("checkpoint.async_save=maybe", "checkpoint.async_save")],
)
def test_wrong_types_fail_while_composing_and_name_the_key(override, key):
    with pytest.raises(ConfigError, match=f"config key '{key}': must be "):
        compose_config([override])


@pytest.mark.parametrize(
    ("override", "key"),
    [("model.hidden=abc", "model.hidden"), ("+model.bogus=1", "model.bogus"), ("model.min_std=fast", "model.min_std"),
     ("seed=abc", "seed"), ("seed=-1", "seed")],
)
def test_model_keys_are_checked_against_the_model_signature(override, key):
    cfg = compose_config([override])
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate_config(cfg, world_size=2)


def test_every_group_option_starts_from_its_schema():
    from worldpipe.config.schema import GROUP_SCHEMAS

    for group in GROUP_SCHEMAS:
        for option in (CONF_DIR / group).glob("*.yaml"):
            assert "- schema" in option.read_text(), f"{option} does not start from its schema"


# ---- issue 51: a group's schema is never an option; planner is a group like the others ----

SCHEMA_GROUPS = ("data", "trainer", "parallel", "checkpoint", "tracking", "numerics")


@pytest.mark.parametrize("group", SCHEMA_GROUPS)
@pytest.mark.parametrize("spelling", ["{group}=schema", "+{group}=schema", "{group}=bogus"])
def test_a_groups_schema_is_neither_offered_nor_accepted(group, spelling):
    options = sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))
    override = spelling.format(group=group)
    with pytest.raises(ConfigError) as refused:
        compose_config(["experiment=smoke", override])
    line = str(refused.value)
    assert line == f"config group '{group}': no option '{override.rpartition('=')[2]}'; available: {', '.join(options)}"
    assert "schema" not in line.rpartition("available:")[2]


def test_planner_is_a_group_like_the_others_outside_the_run_identity():
    plain = compose_config(["experiment=smoke"])
    cem = compose_config(["experiment=smoke", "planner=cem", "planner.horizon=4"])
    assert "planner" not in plain
    assert cem.planner["_target_"].endswith("CEM") and cem.planner.horizon == 4
    assert config_hash(cem) == config_hash(plain)  # training does not read it
    with pytest.raises(ConfigError, match=r"^config group 'planner': no option 'bogus'; available: cem, mppi$"):
        compose_config(["experiment=smoke", "planner=bogus"])


def test_values_set_on_a_composed_config_equal_composing_with_them():
    # A loop's rounds differ from its round 0 only in values: set on a copy, the config is the one Hydra composes.
    base = ["experiment=pendulum_scratch", "parallel.nproc_per_node=1"]
    values = ["data.name=pendulum_random-round3", "seed=3", "+init_from=pendulum_scratch/00ab12", "trainer.lr=3e-4"]
    composed_base = compose_config(base)
    derived = with_values(composed_base, values)
    assert to_container(derived) == to_container(compose_config([*base, *values]))
    assert config_hash(derived) == config_hash(compose_config([*base, *values])) != config_hash(composed_base)
    assert "init_from" not in composed_base  # a copy: the base is unchanged
    with pytest.raises(ValueError, match="not a plain value"):
        with_values(composed_base, ["model=gru"])
    with pytest.raises(ConfigError, match="config key 'trainer.lr_typo': not a key of the trainer group"):
        with_values(composed_base, ["trainer.lr_typo=0.1"])
