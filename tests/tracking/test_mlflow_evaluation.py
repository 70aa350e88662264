"""`worldpipe evaluate` records on the training run it evaluated: metrics by horizon, datasets, the model.

One real smoke training (1 rank, SQLite tracking, system metrics every second), evaluated twice the same way
(nothing may be duplicated) and once with another horizon (a nested child run); the logged pyfunc model is
loaded in a fresh process and must predict what `worldpipe evaluate` predicted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from mlflow.tracking import MlflowClient

from datasets import SMOKE_SPEC, build_dataset
from mlflow_support import train_command
from worldpipe.tracking.evaluation import EXPERIMENT_KIND_TAG, MODEL_TRAINING_KIND
from worldpipe.tracking.history import duplicate_steps, histories

# Whole pipelines in the module fixture: well past the default per-test timeout on a busy 2-core machine.
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(2400)]

CONTEXT, HORIZON, OTHER_HORIZON = 4, 8, 6
MODEL_NAME = "smoke-world-model"


def _run(cmd: list[str], env: dict, cwd: Path, timeout: int = 400) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def _evaluate(root: Path, run_dir: Path, heldout: tuple[Path, Path], uri: str, env: dict, name: str,
              horizon: int = HORIZON) -> subprocess.CompletedProcess:
    store, manifest = heldout
    return _run(["worldpipe", "evaluate", "--checkpoints", str(run_dir / "checkpoints"), "--store", str(store),
                 "--manifest", str(manifest), "--context", str(CONTEXT), "--horizon", str(horizon),
                 "--out", str(root / f"{name}.json"), "--plot", str(root / f"{name}.png"),
                 "--predictions", str(root / f"{name}.npz"), "--tracking-uri", uri,
                 "--register-as", MODEL_NAME], env, root)


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory, smoke_dataset, env_with_venv):
    root = tmp_path_factory.mktemp("evaluated")
    env = dict(env_with_venv, OMP_NUM_THREADS="1")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    heldout = build_dataset(root / "heldout", env, {**SMOKE_SPEC, "name": "smoke-heldout", "episodes": 6,
                                                    "seed": 1000})
    run_dir = root / "run"
    _run(train_command(run_dir, smoke_dataset, uri, "parallel.nproc_per_node=1", "trainer.steps=20",
                       "tracking.system_metrics_interval_s=1"), env, root)
    first = _evaluate(root, run_dir, heldout, uri, env, "first")
    second = _evaluate(root, run_dir, heldout, uri, env, "second")
    other = _evaluate(root, run_dir, heldout, uri, env, "other", OTHER_HORIZON)
    done = json.loads((run_dir / "train_done.json").read_text())
    return {"root": root, "uri": uri, "env": env, "done": done, "run_id": done["mlflow_run_id"],
            "client": MlflowClient(uri), "first": first, "second": second, "other": other,
            "smoke": smoke_dataset, "heldout": heldout}


def test_metrics_by_horizon_are_on_the_training_run_once(evaluated):
    client, run_id = evaluated["client"], evaluated["run_id"]
    result = json.loads((evaluated["root"] / "first.json").read_text())
    step = result["checkpoint_step"]
    history = histories(client, run_id)
    for name, values in (("model_mse", result["model_mse"]), ("baseline_mse", result["baseline_mse"]),
                         ("mse_ratio", result["ratio"])):
        assert name not in history  # a horizon is never a step: every eval/ metric is at the training step
        for horizon, value in enumerate(values, start=1):
            assert [(s, v) for s, _, v in history[f"eval/per_horizon/{name}/h{horizon:02d}"]] == [(step, value)]
    assert [(s, v) for s, _, v in history["eval/one_step_ratio"]] == [(step, result["ratio"][0])]
    assert [(s, v) for s, _, v in history["eval/final_ratio"]] == [(step, result["ratio"][-1])]
    assert not duplicate_steps(history)
    tags = client.get_run(run_id).data.tags
    assert tags["worldpipe.eval.checkpoint_digest"] == evaluated["done"]["digest"]
    assert tags["worldpipe.eval.heldout_dataset_hash"] == result["heldout_dataset_hash"]
    assert tags["worldpipe.eval.complete"] == tags["worldpipe.eval.key"]
    files = {a.path for a in client.list_artifacts(run_id, "evaluation")}
    # the second evaluation was a no-op
    assert files == {"evaluation/first.json", "evaluation/first.png", "evaluation/by_horizon.json"}
    assert "already on" in evaluated["second"].stderr


def test_the_experiment_opens_in_the_model_training_view(evaluated):
    client = evaluated["client"]
    experiment = client.get_experiment(client.get_run(evaluated["run_id"]).info.experiment_id)
    assert experiment.tags[EXPERIMENT_KIND_TAG] == MODEL_TRAINING_KIND


def test_training_and_heldout_datasets_are_run_inputs(evaluated):
    run = evaluated["client"].get_run(evaluated["run_id"])
    inputs = {(d.dataset.name, {t.key: t.value for t in d.tags}["mlflow.data.context"]): d.dataset
              for d in run.inputs.dataset_inputs}
    assert set(inputs) == {("smoke", "training"), ("smoke-heldout", "evaluation")}
    for (name, _), dataset in inputs.items():
        manifest_path = evaluated["smoke"][1] if name == "smoke" else evaluated["heldout"][1]
        store_path = evaluated["smoke"][0] if name == "smoke" else evaluated["heldout"][0]
        full_hash = json.loads(Path(manifest_path).read_text())["dataset_hash"]
        assert full_hash.startswith(dataset.digest) and json.loads(dataset.profile)["dataset_hash"] == full_hash
        assert json.loads(dataset.source)["uri"] == str(store_path)
        assert {"obs", "action", "reward"} <= {s["name"] for s in
                                              json.loads(json.loads(dataset.schema)["mlflow_tensorspec"]["features"])}


def test_evaluating_again_duplicates_nothing(evaluated):
    client, run_id = evaluated["client"], evaluated["run_id"]
    experiment_id = client.get_run(run_id).info.experiment_id
    models = client.search_logged_models([experiment_id], filter_string=f"source_run_id = '{run_id}'")
    assert len(models) == 1
    versions = client.search_model_versions(f"name = '{MODEL_NAME}'")
    assert [v.tags["worldpipe.checkpoint.digest"] for v in versions] == [evaluated["done"]["digest"]]
    assert len(client.get_run(run_id).inputs.dataset_inputs) == 2


def test_another_horizon_goes_to_a_nested_child_run(evaluated):
    client, run_id = evaluated["client"], evaluated["run_id"]
    experiment_id = client.get_run(run_id).info.experiment_id
    children = client.search_runs([experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{run_id}'")
    assert len(children) == 1
    child = children[0]
    child_history = histories(client, child.info.run_id)
    assert sorted(k for k in child_history if k.startswith("eval/per_horizon/model_mse/")) == [
        f"eval/per_horizon/model_mse/h{h:02d}" for h in range(1, OTHER_HORIZON + 1)]
    # the training run's evaluation is untouched
    assert len([k for k in histories(client, run_id) if k.startswith("eval/per_horizon/model_mse/")]) == HORIZON


def test_the_logged_model_carries_its_evaluation_and_datasets(evaluated):
    client, run_id = evaluated["client"], evaluated["run_id"]
    experiment_id = client.get_run(run_id).info.experiment_id
    (model,) = client.search_logged_models([experiment_id], filter_string=f"source_run_id = '{run_id}'")
    metrics = {(m.key, m.run_id): m for m in model.metrics}
    result = json.loads((evaluated["root"] / "first.json").read_text())
    assert metrics[("eval/one_step_ratio", run_id)].value == result["ratio"][0]
    assert metrics[("eval/per_horizon/mse_ratio/h08", run_id)].value == result["ratio"][-1]
    assert not any(key.startswith("system/") for key, _ in metrics)
    assert metrics[("loss/total", run_id)].step == result["checkpoint_step"]
    assert {(m.dataset_name, m.key.startswith("eval/")) for m in model.metrics if m.run_id == run_id} == {
        ("smoke", False), ("smoke-heldout", True)}
    link = f"/#/experiments/{experiment_id}/models/{model.model_id}?workflowType=machine_learning"
    assert f"logged model: http://127.0.0.1:5000{link}" in evaluated["first"].stdout  # `mlflow ui` on SQLite


def test_system_metrics_were_sampled_on_the_training_run(evaluated):
    metrics = evaluated["client"].get_run(evaluated["run_id"]).data.metrics
    assert any(key.startswith("system/cpu_utilization") for key in metrics), sorted(metrics)
    assert any(key.startswith("system/system_memory_usage") for key in metrics), sorted(metrics)


def test_pyfunc_model_in_a_fresh_process_predicts_what_evaluate_predicted(evaluated, tmp_path):
    saved = np.load(evaluated["root"] / "first.npz")
    inputs = tmp_path / "inputs.npz"
    np.savez(inputs, obs=saved["obs"][:, :CONTEXT], action=saved["action"])
    script = (
        "import sys, mlflow, numpy as np\n"
        "mlflow.set_tracking_uri(sys.argv[1])\n"
        f"model = mlflow.pyfunc.load_model('models:/{MODEL_NAME}/1')\n"
        "data = np.load(sys.argv[2])\n"
        "np.save(sys.argv[3], model.predict({'obs': data['obs'], 'action': data['action']}))\n"
    )
    out = tmp_path / "pyfunc.npy"
    env = {k: v for k, v in evaluated["env"].items() if k != "PYTHONPATH"}
    _run([sys.executable, "-c", script, evaluated["uri"], str(inputs), str(out)], env, tmp_path)
    predicted = np.load(out)
    assert predicted.shape == saved["predicted"].shape == (saved["obs"].shape[0], HORIZON, saved["obs"].shape[2])
    assert np.array_equal(predicted, saved["predicted"])
    assert os.path.exists(evaluated["root"] / "first.png")


@pytest.fixture(scope="module")
def controlled(evaluated):
    """The same run evaluated in the closed loop (tiny settings), twice: the second must add nothing."""
    root, env, uri = evaluated["root"], evaluated["env"], evaluated["uri"]
    args = ["worldpipe", "control", "evaluate", "--checkpoints", str(root / "run" / "checkpoints"),
            "--env-id", "Pendulum-v1", "--behaviour-policy", "noisy_controller", "--episodes", "3",
            "--max-steps", "10", "--context", "4", "--set", "horizon=4", "--set", "samples=8",
            "--out", str(root / "control.json"), "--tracking-uri", uri]
    first, second = _run(args, env, root), _run(args, env, root)
    return {"record": json.loads((root / "control.json").read_text()), "first": first, "second": second}


def test_closed_loop_returns_are_on_a_child_run_per_episode_and_summarised_on_the_run_and_model(controlled,
                                                                                                  evaluated):
    client, run_id, record = evaluated["client"], evaluated["run_id"], controlled["record"]
    experiment_id = client.get_run(run_id).info.experiment_id
    (child,) = client.search_runs([experiment_id], filter_string=f"tags.`worldpipe.eval.of` = '{run_id}' AND "
                                  "tags.`worldpipe.control.complete` != ''")
    assert child.data.tags["mlflow.parentRunId"] == run_id and child.info.run_name.endswith("-control-MPPI")
    assert child.data.params["control.planner.horizon"] == "4" and child.data.params["control.episodes"] == "3"
    child_history = histories(client, child.info.run_id)
    for name in ("random", "behaviour", "planner", "ceiling"):
        returns = record["contenders"][name]["returns"]
        assert [(s, v) for s, _, v in child_history[f"control/{name}/return"]] == list(enumerate(returns))
    step = record["checkpoint_step"]
    run_history = histories(client, run_id)
    planner = record["contenders"]["planner"]
    assert [(s, v) for s, _, v in run_history["control/planner/return_mean"]] == [(step, planner["mean"])]
    assert [(s, v) for s, _, v in run_history["control/score"]] == [(step, record["score"])]
    assert not duplicate_steps(run_history) and not duplicate_steps(child_history)
    (model,) = client.search_logged_models([experiment_id], filter_string=f"source_run_id = '{run_id}'")
    on_model = sorted((m.step, m.value) for m in client.get_logged_model(model.model_id).metrics
                      if m.key == "control/planner/return")
    assert on_model == list(enumerate(planner["returns"]))
    assert "logged to MLflow run" in controlled["second"].stdout


def test_every_run_ends_with_a_status_and_an_end_time(controlled, evaluated):
    """The training run, the evaluation's child run and the closed loop's child run: none is left RUNNING."""
    client, run_id = evaluated["client"], evaluated["run_id"]
    experiment_id = client.get_run(run_id).info.experiment_id
    runs = client.search_runs([experiment_id])
    assert {r.info.run_name.rsplit("-", 1)[-1] for r in runs} >= {"MPPI", "000020"}  # both kinds of child
    for run in runs:
        assert run.info.status == "FINISHED" and run.info.end_time, (run.info.run_name, run.info.status)

