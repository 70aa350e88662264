"""Issue 19, items 6-11: bad input is refused by the checks that run before any process starts, naming the key.

In-process: the same functions the launcher (`launch.preflight`) and the Snakefile (`pipeline.plan`,
`pipeline.sweep.check_sweep`) call. The command-line and Snakemake ends are in tests/project/test_refusals_cli.py.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from worldpipe.config.compose import value_override
from worldpipe.config.identity import ConfigError
from worldpipe.config.tracking_uri import tracking_uri_problem
from worldpipe.launch.preflight import check_data, checked_config
from worldpipe.pipeline.plan import PipelineError, plan
from worldpipe.pipeline.sweep import SweepError, check_sweep
from worldpipe.pipeline.sweep import load_pipeline_config as load_config

REPO = Path(__file__).resolve().parents[2]
CONF = REPO / "conf"


def smoke_pipeline(**changes) -> dict:
    config = yaml.safe_load((CONF / "pipeline" / "smoke.yaml").read_text())
    config.update(changes)
    return config


# ---- item 7: model sizes ----

@pytest.mark.parametrize(("overrides", "key"), [
    (["experiment=smoke", "model.stoch=-1"], "model.stoch"),
    (["experiment=smoke", "model.deter=-3"], "model.deter"),
    (["experiment=smoke", "model.stoch=0"], "model.stoch"),
    (["experiment=smoke", "model.hidden=0"], "model.hidden"),
    (["experiment=smoke_gru", "model.embed=0"], "model.embed"),
    (["experiment=smoke_ssm", "model.layers=0"], "model.layers"),
    (["experiment=smoke_transformer", "model.heads=-2"], "model.heads"),
    (["experiment=smoke_augmented", "model.inner.stoch=0"], "model.inner.stoch"),
])
def test_model_sizes_must_be_positive(overrides, key):
    with pytest.raises(ConfigError, match=rf"config key '{key}': must be a positive integer"):
        checked_config(overrides)


# ---- item 6: a window longer than the episodes ----

def test_window_longer_than_the_episodes_is_refused_from_the_manifest(smoke_dataset):
    store, manifest = smoke_dataset
    cfg = checked_config(["experiment=smoke", "data.window=100000", f"data.store={store}",
                          f"data.manifest={manifest}"])
    with pytest.raises(ConfigError, match=r"config key 'data.window': 100000 steps .* at most 64 steps") as refused:
        check_data(cfg)
    assert str(manifest) in str(refused.value)
    check_data(checked_config(["experiment=smoke", "data.window=64", f"data.store={store}",
                               f"data.manifest={manifest}"]))


def test_a_frame_model_on_a_dataset_without_frames_is_refused_naming_the_model(smoke_dataset):
    store, manifest = smoke_dataset  # pixels: false
    cfg = checked_config(["experiment=pendulum_pixels", "data.window=16", f"data.store={store}",
                          f"data.manifest={manifest}"])
    with pytest.raises(ConfigError, match=r"config key 'model._target_': .*PixelRSSM learns from frames, but "
                                          r"dataset 'smoke' .* stores none \(set pixels: true"):
        check_data(cfg)


def test_window_longer_than_the_pipeline_datasets_episodes_is_refused_while_planning():
    config = smoke_pipeline()
    config["train"]["overrides"] = ["data.window=100000"]
    with pytest.raises(PipelineError, match=r"data.window': 100000 steps .* at most 64 steps"):
        plan(config, CONF)


def test_the_loader_refuses_windows_that_cannot_train(smoke_dataset):
    from worldpipe.data.loader import WindowError, WindowLoader
    from worldpipe.data.sampler import GlobalWindowSampler
    from worldpipe.data.store import TrajectoryStore

    store = TrajectoryStore.open(str(smoke_dataset[0]))
    with pytest.raises(WindowError, match="data.window"):
        WindowLoader(store, GlobalWindowSampler(store.lengths, 100000, 8, 4, 0), 0, 1)
    sampler = GlobalWindowSampler(store.lengths, 8, 8, 4, 0)
    sampler.windows[:, 1] = store.max_steps  # every window starts past its episode's end: no valid step
    with pytest.raises(WindowError, match="no window"):
        WindowLoader(store, sampler, 0, 1)


# ---- item 10: a fixed-mesh layout on another rank count ----

def test_a_fixed_mesh_layout_on_another_rank_count_names_both_keys():
    with pytest.raises(ConfigError, match=r"'parallel.nproc_per_node': 2 ranks .* mesh of 4 ranks "
                                          r"\(parallel.data_parallel=2"):
        checked_config(["experiment=smoke_transformer", "parallel=dp_tp", "parallel.nproc_per_node=2"])
    checked_config(["experiment=smoke_transformer", "parallel=dp_tp", "parallel.nproc_per_node=2",
                    "parallel.data_parallel=1"])  # the rule made explicit: asking for this mesh is allowed
    checked_config(["experiment=smoke_transformer", "parallel=ddp", "parallel.nproc_per_node=4"])  # any N


def test_the_pipeline_refuses_a_layout_against_train_nproc_per_node():
    config = smoke_pipeline(experiments=["smoke_transformer"])
    config["train"]["overrides"] = ["parallel=dp_tp"]  # train.nproc_per_node is 2
    with pytest.raises(PipelineError, match="train.nproc_per_node.*mesh of 4 ranks"):
        plan(config, CONF)


# ---- item 9: tracking URI syntax ----

@pytest.mark.parametrize("uri", ["sqlite:///results/mlflow.db", "sqlite:////abs/mlflow.db", "http://127.0.0.1:5000",
                                 "https://mlflow.example.org/base", "http://[::1]:5000", "file:///tmp/mlruns",
                                 "postgresql://u:p@db:5432/mlflow?sslmode=require", "results/mlruns", ""])
def test_well_formed_tracking_uris_pass(uri):
    assert tracking_uri_problem(uri) is None


@pytest.mark.parametrize("uri", ["htp://localhost:5000", "sqlite//results/mlflow.db", "sqlite:/x.db", "sqlite:///",
                                 "http://x; rm -rf ~", "http://x;touch", "$(touch x)", "`id`", "mlruns;id",
                                 "http://localhost:99999", "http://:5000", "postgresql://db", "sqlite:///${x}"])
def test_malformed_tracking_uris_are_refused(uri):
    assert tracking_uri_problem(uri) is not None


def test_training_refuses_a_bad_tracking_uri_naming_the_key(monkeypatch):
    with pytest.raises(ConfigError, match="config key 'tracking.uri': 'htp://localhost:5000' has an unknown scheme"):
        checked_config(["experiment=smoke", "tracking.uri=htp://localhost:5000"])
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite//typo.db")
    with pytest.raises(ConfigError, match=r"config key 'tracking.uri': unset, so \$MLFLOW_TRACKING_URI"):
        checked_config(["experiment=smoke"])


def test_the_pipeline_refuses_a_bad_tracking_uri_naming_the_key():
    with pytest.raises(PipelineError, match="^tracking_uri: 'http://x; rm -rf ~' contains whitespace"):
        plan(smoke_pipeline(tracking_uri="http://x; rm -rf ~"), CONF)


def test_a_uri_hydra_cannot_read_unquoted_reaches_training_quoted():
    from hydra.core.override_parser.overrides_parser import OverridesParser

    uri = "postgresql://u:p@db:5432/mlflow?sslmode=require&x=it's"
    override = value_override("tracking.uri", uri)
    assert OverridesParser.create().parse_override(override).value() == uri
    assert value_override("tracking.uri", "http://127.0.0.1:5000") == "tracking.uri=http://127.0.0.1:5000"


# ---- item 8: sweep files ----

def sweep_config(**changes) -> dict:
    config = yaml.safe_load((CONF / "pipeline" / "sweep_smoke.yaml").read_text())
    config["sweep"].update(changes)
    return config


@pytest.mark.parametrize(("changes", "message"), [
    ({"grid": {"trainer.lrr": [0.1, 0.2]}}, r"'sweep.grid.trainer.lrr': .* not a key .*did you mean trainer.lr"),
    ({"grid": {"trainer.lr": [-1, 0.1]}}, r"sweep point trainer.lr--1 .* config key 'trainer.lr': must be > 0"),
    ({"grid": {"model.stoch": [0]}}, r"config key 'model.stoch': must be a positive integer"),
    ({"grid": {}}, r"'sweep.grid': must map at least one key"),
    ({"name": "../../etc"}, r"'sweep.name': '../../etc' is not a safe directory name"),
    ({"name": ".."}, r"'sweep.name': '..' is not"),
    ({"name": "/"}, r"'sweep.name': '/' is not"),
    ({"name": ""}, r"'sweep.name': '' is not"),
    ({"experiment": "nosuch"}, r"'sweep.experiment': no experiment 'nosuch'"),
])
def test_bad_sweeps_are_refused_naming_the_key(changes, message):
    with pytest.raises(SweepError, match=message):
        check_sweep(sweep_config(**changes), CONF)


def test_the_smoke_sweep_passes():
    assert len(check_sweep(sweep_config(), CONF)) == 4


def test_sweep_points_cli_names_the_file_and_the_yaml_error(tmp_path, capsys):
    from worldpipe.cli import main

    broken = tmp_path / "broken.yaml"
    broken.write_text((CONF / "pipeline" / "sweep_smoke.yaml").read_text().replace("[1.0e-3, 3.0e-3]", "[1.0e-3"))
    assert main(["sweep", "points", str(broken)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {broken}: not valid YAML at line ") and "\n" not in err
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(sweep_config(grid={"trainer.lrr": [0.1]})))
    assert main(["sweep", "points", str(bad)]) == 2
    assert capsys.readouterr().err.startswith(f"error: {bad}: config key 'sweep.grid.trainer.lrr'")
    assert isinstance(load_config(CONF / "pipeline" / "sweep_smoke.yaml"), dict)


# ---- item 11: a busy run directory is refused before the config is composed ----

HOLDER = ("import sys, time; from worldpipe.launch.run_lock import RunLock; RunLock(sys.argv[1]).acquire(); "
          "print('held', flush=True); time.sleep(600)")
SECOND = ("import sys; from worldpipe.cli import main; code = main(sys.argv[1:]); "
          "print('torch imported' if 'torch' in sys.modules else 'torch not imported'); sys.exit(code)")


def test_a_busy_run_directory_is_refused_before_the_config_is_validated(tmp_path, smoke_dataset):
    # The validation imports torch (seconds on a loaded machine): a refusal that did not need it must not wait for it.
    store, manifest = smoke_dataset
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert holder.stdout.readline().strip() == "held"
        second = subprocess.run([sys.executable, "-c", SECOND, "train", "experiment=smoke", f"run_dir={run_dir}",
                                 f"data.store={store}", f"data.manifest={manifest}", "trainer.lr=-1"],
                                capture_output=True, text=True, env=env, timeout=120)
    finally:
        holder.kill()
        holder.wait(timeout=30)
    assert second.returncode == 1, second.stderr
    lines = second.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"error: run directory {run_dir} is in use by pid {holder.pid} on host {socket.gethostname()}"), lines
    assert second.stdout.strip() == "torch not imported"


@pytest.mark.parametrize(("overrides", "line"), [
    (["experiment=smoke", "trainer.steps=abc"], "config key 'trainer.steps': must be an integer, got 'abc'"),
    (["trainer.lr=fast"], "config key 'trainer.lr': must be a number, got 'fast'"),
    (["experiment=smoke", "trainer.lrr=1"], "config key 'trainer.lrr': not a key of the trainer group; did you mean "
                                            "trainer.lr?"),
    (["experiment=smoke", "+trainer.lrr=1"], "config key 'trainer.lrr': not a key of the trainer group; did you mean "
                                             "trainer.lr?"),
    (["model=nope"], "config group 'model': no option 'nope'; available: augmented_rssm, gru, pixel_rssm, rssm, ssm, "
                     "transformer"),
])
def test_hydra_refusals_are_one_line_naming_the_key_and_the_fix(overrides, line):
    """Issue 40: Hydra's own messages lacked the reason (`Error merging override`), let `+` add a key nothing
    reads, and listed the config search path."""
    with pytest.raises(ConfigError) as refused:
        checked_config(overrides)
    assert str(refused.value) == line


def test_an_unknown_experiment_lists_the_available_ones_in_one_short_line():
    with pytest.raises(ConfigError) as refused:
        checked_config(["experiment=nope"])
    # the option names and nothing else (Hydra's own message is several lines with the search path)
    experiments = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))
    assert str(refused.value) == f"config group 'experiment': no option 'nope'; available: {', '.join(experiments)}"
