"""Sweep runs in a real (SQLite) MLflow store: parents expand to their points, tables show what differs,
plots average seeds with error bars, evaluations are idempotent per key."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from worldpipe.tracking.comparison import ComparisonError, comparison_table, plot_comparison, resolve
from worldpipe.tracking.datasets import EVALUATION, TRAINING, DatasetRecord
from worldpipe.tracking.evaluation import EvaluationRecord, log_evaluation, log_model_evaluation
from worldpipe.tracking.groups import link_point, open_parent_run, point_runs, summarize_sweep
from worldpipe.tracking.history import duplicate_steps, histories

pytestmark = pytest.mark.integration  # a real SQLite MLflow store (its schema migrations take a few seconds)

RATIO = {(1e-3, 0): 0.9, (1e-3, 1): 0.7, (3e-3, 0): 0.5, (3e-3, 1): 0.4}


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    client = MlflowClient(f"sqlite:///{tmp_path_factory.mktemp('store') / 'mlflow.db'}")
    parent = open_parent_run(client, "worldpipe", "lr", ["trainer.lr", "seed"], len(RATIO),
                             {"trainer.lr": [1e-3, 3e-3], "seed": [0, 1]})
    experiment_id = client.get_run(parent).info.experiment_id
    for (lr, seed), ratio in RATIO.items():
        run_id = client.create_run(experiment_id, run_name=f"lr{lr}-s{seed}").info.run_id
        for key, value in {"trainer.lr": lr, "seed": seed, "model.stoch": 4, "run_dir": f"r/{lr}/{seed}"}.items():
            client.log_param(run_id, key, value)
        client.log_metric(run_id, "eval/one_step_ratio", ratio, step=40)
        client.log_metric(run_id, "loss/total", 10 * ratio, step=40)
        link_point(client, parent, run_id, "lr", f"trainer.lr-{lr}__seed-{seed}", {"trainer.lr": lr, "seed": seed})
    return client, parent


def test_a_parent_stands_for_its_points_and_is_found_again(sweep):
    client, parent = sweep
    assert open_parent_run(client, "worldpipe", "lr", ["trainer.lr", "seed"], 4) == parent
    comparison = resolve(client, [parent])
    assert len(comparison.runs) == 4 and comparison.swept == ["trainer.lr", "seed"]
    assert {r.info.run_id for r in comparison.runs} == {r.info.run_id for r in point_runs(client, parent)}


def test_table_lists_differing_params_but_not_naming_ones(sweep):
    client, parent = sweep
    table = comparison_table(resolve(client, [parent]))
    rows = {line.split()[0]: line.split()[1:] for line in table.splitlines() if line.strip()}
    assert rows["trainer.lr"] == ["0.001", "0.001", "0.003", "0.003"]
    assert sorted(rows["eval/one_step_ratio"]) == sorted(f"{v:.6g}" for v in RATIO.values())
    assert "model.stoch" not in rows and "run_dir" not in rows


def test_plot_averages_seeds_with_their_spread(sweep, tmp_path):
    client, parent = sweep
    series = plot_comparison(resolve(client, [parent]), tmp_path / "plot.png")
    (points,) = series.values()
    assert [(x, n) for x, _, _, n in points] == [(1e-3, 2), (3e-3, 2)]
    assert points[0][1] == pytest.approx(statistics.fmean([0.9, 0.7]))
    assert points[0][2] == pytest.approx(statistics.pstdev([0.9, 0.7]))
    assert (tmp_path / "plot.png").read_bytes()[:4] == b"\x89PNG"


def test_unknown_runs_and_missing_metrics_are_one_clear_error(sweep, tmp_path):
    client, parent = sweep
    with pytest.raises(ComparisonError, match="no MLflow run 'nope'"):
        resolve(client, ["nope"])
    with pytest.raises(ComparisonError, match="eval/final_ratio"):
        plot_comparison(resolve(client, [parent]), tmp_path / "p.png", metric="eval/final_ratio")


def test_the_same_evaluation_twice_logs_once_and_another_key_goes_to_a_child(sweep):
    client, parent = sweep
    experiment_id = client.get_run(parent).info.experiment_id
    run = client.create_run(experiment_id, run_name="evaluated")  # not a sweep point: the other tests stay put
    result = {"heldout_dataset_hash": "h" * 64, "context": 4, "horizon": 3, "model_mse": [1.0, 2.0, 3.0],
              "baseline_mse": [2.0, 2.0, 2.0], "ratio": [0.5, 1.0, 1.5]}
    record = EvaluationRecord(run.info.run_id, "d" * 64, 40, result)
    first, again = log_evaluation(client.tracking_uri, record), log_evaluation(client.tracking_uri, record)
    assert (first.logged, again.logged, first.child) == (True, False, False)
    assert _evaluation_steps(client, run.info.run_id) == {40}
    other = log_evaluation(client.tracking_uri, EvaluationRecord(run.info.run_id, "e" * 64, 50, result))
    assert other.child and other.run_id != run.info.run_id
    assert client.get_run(other.run_id).data.tags["mlflow.parentRunId"] == run.info.run_id
    assert _evaluation_steps(client, run.info.run_id) == {40}
    assert _evaluation_steps(client, other.run_id) == {50}


def _evaluation_steps(client, run_id: str) -> set[int]:
    """Steps of every eval/ metric of a run (the training step evaluated: never a horizon)."""
    return {step for key, points in histories(client, run_id).items() if key.startswith("eval/")
            for step, _, _ in points}


def test_error_by_horizon_is_named_by_horizon_and_tabled_not_stepped(sweep, tmp_path):
    client, parent = sweep
    run_id = client.create_run(client.get_run(parent).info.experiment_id, run_name="by-horizon").info.run_id
    result = {**_result(horizon=3), "model_mse": [1.0, 2.0, 3.0], "ratio": [0.5, 1.0, 1.5]}
    log_evaluation(client.tracking_uri, EvaluationRecord(run_id, "d" * 64, 40, result))
    history = histories(client, run_id)
    assert {k: [(s, v) for s, _, v in points] for k, points in history.items() if "/h" in k} == {
        **{f"eval/per_horizon/model_mse/h0{h}": [(40, float(h))] for h in (1, 2, 3)},
        **{f"eval/per_horizon/baseline_mse/h0{h}": [(40, 2.0)] for h in (1, 2, 3)},
        **{f"eval/per_horizon/mse_ratio/h0{h}": [(40, r)] for h, r in ((1, 0.5), (2, 1.0), (3, 1.5))}}
    assert not {"eval/model_mse", "eval/baseline_mse", "eval/mse_ratio"} & set(history)
    table = json.loads(Path(client.download_artifacts(run_id, "evaluation/by_horizon.json", str(tmp_path))).read_text())
    assert table == {"columns": ["horizon", "model_mse", "baseline_mse", "mse_ratio"],
                     "data": [[1, 1.0, 2.0, 0.5], [2, 2.0, 2.0, 1.0], [3, 3.0, 2.0, 1.5]]}


def test_the_logged_model_carries_the_evaluation_and_its_datasets(sweep):
    client, parent = sweep
    experiment_id = client.get_run(parent).info.experiment_id
    run_id = client.create_run(experiment_id, run_name="modelled").info.run_id
    client.log_metric(run_id, "loss/total", 3.0, step=40)
    client.log_metric(run_id, "loss/total", 9.0, step=50)  # after the checkpoint: not the model's loss
    arrays = {"obs": {"shape": [6, 10, 3], "dtype": "float32"}}
    datasets = (DatasetRecord("train-set", "/d/train", "t" * 64, arrays, context=TRAINING),
                DatasetRecord("heldout-set", "/d/heldout", "h" * 64, arrays, context=EVALUATION))
    record = EvaluationRecord(run_id, "d" * 64, 40, _result(), datasets=datasets)
    log_evaluation(client.tracking_uri, record)
    model_id = client.create_logged_model(experiment_id, source_run_id=run_id, name="world_model").model_id
    assert log_model_evaluation(client.tracking_uri, record, run_id, model_id) == 3 * 3 + 2 + 1
    assert log_model_evaluation(client.tracking_uri, record, run_id, model_id) == 0  # once
    metrics = {m.key: m for m in client.get_logged_model(model_id).metrics}
    assert metrics["loss/total"].value == 3.0 and metrics["loss/total"].step == 40
    assert (metrics["loss/total"].dataset_name, metrics["loss/total"].dataset_digest) == ("train-set", "t" * 32)
    assert {(m.dataset_name, m.dataset_digest) for k, m in metrics.items() if k.startswith("eval/")} == {
        ("heldout-set", "h" * 32)}
    assert not duplicate_steps(histories(client, run_id))  # the model's metrics are the run's, not new ones


def test_the_parent_holds_the_swept_values_and_the_best_point(sweep):
    client, parent = sweep
    best = summarize_sweep(client, parent, "eval/one_step_ratio", ["loss/total"])
    run = client.get_run(parent)
    assert run.data.params == {"sweep.points": "4", "trainer.lr": "[0.001, 0.003]", "seed": "[0, 1]"}
    assert best.info.run_name == "lr0.003-s1" == run.data.tags["worldpipe.sweep.best_run"]
    assert run.data.metrics == {"eval/one_step_ratio": 0.4, "loss/total": 4.0}
    assert "lr0.003-s1" in run.data.tags["mlflow.note.content"]


def _result(heldout: str = "h" * 64, context: int = 4, horizon: int = 3) -> dict:
    return {"heldout_dataset_hash": heldout, "context": context, "horizon": horizon,
            "model_mse": [1.0] * horizon, "baseline_mse": [2.0] * horizon, "ratio": [0.5] * horizon}


# Each part of an evaluation's key, changed alone: (checkpoint digest, held-out data, context, horizon).
KEY_PARTS = {
    "checkpoint_digest": lambda run_id: EvaluationRecord(run_id, "f" * 64, 40, _result()),
    "heldout_dataset_hash": lambda run_id: EvaluationRecord(run_id, "d" * 64, 40, _result(heldout="g" * 64)),
    "context": lambda run_id: EvaluationRecord(run_id, "d" * 64, 40, _result(context=8)),
    "horizon": lambda run_id: EvaluationRecord(run_id, "d" * 64, 40, _result(horizon=5)),
}


@pytest.mark.parametrize("part", sorted(KEY_PARTS))
def test_each_part_of_the_key_makes_another_evaluation(sweep, part):
    """An evaluation that differs in one part of its key is logged (to a child run), never skipped as done."""
    client, parent = sweep
    run_id = client.create_run(client.get_run(parent).info.experiment_id, run_name=f"by-{part}").info.run_id
    first = log_evaluation(client.tracking_uri, EvaluationRecord(run_id, "d" * 64, 40, _result()))
    assert first.logged and not first.child
    same = EvaluationRecord(run_id, "d" * 64, 40, {**_result(), "model_mse": [9.0, 9.0, 9.0]})
    assert not log_evaluation(client.tracking_uri, same).logged  # values are not part of the key
    other = log_evaluation(client.tracking_uri, KEY_PARTS[part](run_id))
    assert other.logged and other.child, f"an evaluation with another {part} was taken for the first one"
    assert client.get_run(other.run_id).data.tags["worldpipe.eval.of"] == run_id
