"""Cases 5, 6 and 8 of issue 9, the cheap part: hostile or mistaken input is refused before any process
starts, as one line naming the file or key, with a non-zero exit; the pipeline validates every experiment's
composed config while the Snakefile is parsed and hands overrides to the shell only quoted."""

from __future__ import annotations

import json
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

from datasets import build_dataset
from pipeline_project import planned_jobs

pytestmark = [pytest.mark.adversarial, pytest.mark.integration]


def train(run_dir: Path, store, manifest, env, *extra: str) -> subprocess.CompletedProcess:
    cmd = ["worldpipe", "train", "experiment=smoke", f"run_dir={run_dir}", f"data.store={store}",
           f"data.manifest={manifest}", "tracking.enabled=false", *extra]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)


def assert_one_line_refusal(proc: subprocess.CompletedProcess, *needles: str) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode != 0
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ") and "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def assert_nothing_started(run_dir: Path) -> None:
    # A worker would have written Hydra's output dir, a checkpoint dir or a log into the run directory.
    assert not (run_dir / "hydra").exists() and not (run_dir / "checkpoints").exists()


@pytest.fixture(scope="module")
def other_dataset(tmp_path_factory, env_with_venv):
    """A second real dataset (other seed, other size): its manifest does not belong to the smoke store."""
    from datasets import SMOKE_SPEC

    spec = dict(SMOKE_SPEC, name="other", episodes=8, seed=5)
    return build_dataset(tmp_path_factory.mktemp("other_data"), env_with_venv, spec)


@pytest.mark.parametrize(("extra", "needle"), [
    (["model.hidden=abc"], "model.hidden"),
    (["seed=abc"], "'seed'"),
    (["parallel.nproc_per_node=two"], "parallel.nproc_per_node"),
    (["trainer.lr=-1"], "trainer.lr"),
    (["trainer.batch_sise=3"], "trainer.batch_sise"),
    (["not-an-override"], "not-an-override"),
])
def test_bad_overrides_are_one_line_before_any_process(extra, needle, tmp_path, smoke_dataset, env_with_venv):
    proc = train(tmp_path / "run", *smoke_dataset, env_with_venv, *extra)
    assert_one_line_refusal(proc, needle)
    assert_nothing_started(tmp_path / "run")


def test_missing_store_and_manifest_are_named(tmp_path, smoke_dataset, env_with_venv):
    store, manifest = smoke_dataset
    proc = train(tmp_path / "run", tmp_path / "nope.zarr", manifest, env_with_venv)
    assert_one_line_refusal(proc, "data.store", "nope.zarr")
    proc = train(tmp_path / "run", store, tmp_path / "nope.json", env_with_venv)
    assert_one_line_refusal(proc, "data.manifest", "nope.json")
    assert_nothing_started(tmp_path / "run")


def test_another_datasets_manifest_is_called_a_mismatch(tmp_path, smoke_dataset, other_dataset, env_with_venv):
    proc = train(tmp_path / "run", smoke_dataset[0], other_dataset[1], env_with_venv)
    line = assert_one_line_refusal(proc, "another dataset", str(other_dataset[1]), str(smoke_dataset[0]))
    assert "size" not in line  # not the misleading "corrupt dataset file ... size" of a late check
    assert_nothing_started(tmp_path / "run")


def test_tampered_manifest_verify_is_one_line_and_debug_shows_the_traceback(tmp_path, other_dataset,
                                                                          env_with_venv):
    store, manifest = other_dataset
    tampered = tmp_path / "manifest.json"
    body = json.loads(manifest.read_text())
    body["episodes"] += 1
    tampered.write_text(json.dumps(body))
    cmd = ["worldpipe", "data", "verify", str(store), "--manifest", str(tampered)]
    proc = subprocess.run(cmd, env=env_with_venv, capture_output=True, text=True, timeout=120)
    assert_one_line_refusal(proc, str(tampered), "modified")
    debug = subprocess.run(["worldpipe", "--debug", *cmd[1:]], env=env_with_venv, capture_output=True, text=True,
                           timeout=120)
    assert debug.returncode != 0 and "Traceback (most recent call last)" in debug.stderr


# ---- the pipeline: validated while the Snakefile is parsed, overrides quoted ----

def snakemake(repo: Path, workdir: Path, env: dict, overrides: list[str], *args: str, **sections):
    config = yaml.safe_load((repo / "conf" / "pipeline" / "smoke.yaml").read_text())
    config["train"]["overrides"] = overrides
    config.update(sections)
    configfile = workdir / "pipeline.yaml"
    workdir.mkdir(parents=True, exist_ok=True)
    configfile.write_text(yaml.safe_dump(config))
    cmd = ["snakemake", "-s", str(repo / "Snakefile"), "--directory", str(workdir), "--cores", "1",
           "--configfile", str(configfile), *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_pipeline_bad_override_fails_before_the_data_stages(repo, tmp_path, env_with_venv):
    proc = snakemake(repo, tmp_path / "wd", env_with_venv, ["trainer.lr=-1"])
    assert proc.returncode != 0
    output = proc.stdout + proc.stderr
    assert "trainer.lr" in output and "experiment 'smoke'" in output
    assert not (tmp_path / "wd" / "results").exists()  # no stage ran


@pytest.mark.slow
def test_pipeline_schema_rejects_an_override_that_is_not_key_value(repo, tmp_path, env_with_venv):
    proc = snakemake(repo, tmp_path / "wd", env_with_venv, ["touch pwned"], "-n")
    assert proc.returncode != 0
    assert "touch pwned" in proc.stdout + proc.stderr


@pytest.mark.slow
def test_control_null_plans_no_closed_loop(repo, tmp_path, env_with_venv):
    # smoke.yaml has a control section, and so do the defaults it is merged over: null is how to turn it off.
    with_loop = snakemake(repo, tmp_path / "with", env_with_venv, [], "-n")
    without = snakemake(repo, tmp_path / "without", env_with_venv, [], "-n", control=None)
    assert with_loop.returncode == 0 and without.returncode == 0, with_loop.stderr[-3000:] + without.stderr[-3000:]
    rules = lambda proc: {rule for rule, _ in planned_jobs(proc.stdout + proc.stderr)}  # noqa: E731
    closed_loop = {"evaluate_control", "evaluate_references", "plot_control_overview"}
    assert closed_loop <= rules(with_loop)
    assert rules(without) == rules(with_loop) - closed_loop


@pytest.mark.slow
def test_pipeline_overrides_reach_the_shell_quoted(repo, tmp_path, env_with_venv):
    # experiment_name is part of a run's identity, so it travels in the rule's own (printed) command line.
    hostile = "experiment_name='a b; touch PWNED #'"
    proc = snakemake(repo, tmp_path / "wd", env_with_venv, [hostile], "-n", "-p", "--forceall")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if "worldpipe train --dataset-spec-hash" in line]
    assert lines, proc.stdout[-3000:]
    argv = shlex.split(lines[0].split(" > ")[0])
    assert hostile in argv  # one argument, exactly as written: nothing for the shell to interpret
    assert "touch" not in argv
