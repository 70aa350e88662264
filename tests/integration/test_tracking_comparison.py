"""Sweep runs in a real (SQLite) MLflow store: parents expand to their points, tables show what differs,
plots average seeds with error bars, evaluations are idempotent per key."""

from __future__ import annotations

import statistics

import pytest
from mlflow.tracking import MlflowClient

from worldpipe.tracking.comparison import ComparisonError, comparison_table, plot_comparison, resolve
from worldpipe.tracking.evaluation import EvaluationRecord, log_evaluation
from worldpipe.tracking.sweep_runs import link_point, open_parent_run, point_runs

pytestmark = pytest.mark.integration  # a real SQLite MLflow store (its schema migrations take a few seconds)

RATIO = {(1e-3, 0): 0.9, (1e-3, 1): 0.7, (3e-3, 0): 0.5, (3e-3, 1): 0.4}


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    client = MlflowClient(f"sqlite:///{tmp_path_factory.mktemp('store') / 'mlflow.db'}")
    parent = open_parent_run(client, "worldpipe", "lr", ["trainer.lr", "seed"], len(RATIO))
    experiment_id = client.get_run(parent).info.experiment_id
    for (lr, seed), ratio in RATIO.items():
        run_id = client.create_run(experiment_id, run_name=f"lr{lr}-s{seed}").info.run_id
        for key, value in {"trainer.lr": lr, "seed": seed, "model.stoch": 4, "run_dir": f"r/{lr}/{seed}"}.items():
            client.log_param(run_id, key, value)
        client.log_metric(run_id, "eval/one_step_ratio", ratio)
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
    assert [m.step for m in client.get_metric_history(run.info.run_id, "eval/model_mse")] == [1, 2, 3]
    other = log_evaluation(client.tracking_uri, EvaluationRecord(run.info.run_id, "e" * 64, 50, result))
    assert other.child and other.run_id != run.info.run_id
    assert client.get_run(other.run_id).data.tags["mlflow.parentRunId"] == run.info.run_id
    assert [m.step for m in client.get_metric_history(run.info.run_id, "eval/model_mse")] == [1, 2, 3]


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
