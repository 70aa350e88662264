"""Data-collection rounds: the collect-train loop of model-based RL as ordinary datasets and runs of the plan.

A pipeline config declares::

    rounds:
      experiment: pendulum_rssm   # the Hydra experiment every round trains
      count: 2                    # collection rounds after round 0
      episodes: 64                # episodes each collection round adds
      seed: 7000                  # round k's episodes are seeded from seed + k
      exploration_std: 0.3        # Gaussian noise on each action, a fraction of the action box's half-width
      context: 8                  # observed steps the model filters before each decision
      planner: mppi               # conf/planner/<name>.yaml, with planner_overrides
      train_on: union             # union: round k trains on rounds 0..k; latest: on round k's episodes only

Round 0 is the experiment's own run on its declared dataset (the scripted policy's). Round k >= 1 is a dataset
``<base>-round<k>`` collected in the real environment by round k-1's final model
(:mod:`worldpipe.control.collection`), and a run of the same experiment trained on it (``data.name`` set to it, a
new run of the experiment beside round 0's). The collected dataset's spec names round k-1's run by its hash, so
every hash down the chain follows from the config: the DAG is known when the Snakefile is parsed, round k's
identity depends on rounds 0..k only, and raising ``count`` adds rounds without retraining the others.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from worldpipe.config import paths
from worldpipe.config.planner import PlannerConfigError, planner_config
from worldpipe.core.hashing import canonical_hash
from worldpipe.data.spec import CONTINUOUS_ACTION_ENVS, DatasetSpec, spec_hash
from worldpipe.pipeline.plan import Dataset, PipelineError, Run, plan_run

TRAIN_ON = ("union", "latest")


@dataclasses.dataclass(frozen=True)
class Round:
    """Round ``index`` of the loop: the run trained on its dataset (round 0: the scripted policy's)."""

    index: int
    run: Run

    @property
    def dataset(self) -> Dataset:
        return self.run.dataset


def round_dataset_name(base: str, index: int) -> str:
    """The dataset of collection round ``index`` (>= 1) of ``base``."""
    return f"{base}-round{index}"


def collected_spec(rounds: Mapping[str, Any], previous: Round, base: Dataset, planner: dict[str, Any]) -> dict:
    """The spec of the dataset round ``previous.index + 1`` collects with ``previous``'s model."""
    index = previous.index + 1
    parent = previous.dataset
    copied = parent.spec["episodes"] if rounds.get("train_on", "union") == "union" else 0
    collector = {
        "round": index, "base": base.name, "experiment": previous.run.experiment,
        "run_hash": previous.run.run_hash, "parent": {"name": parent.name, "spec_hash": parent.spec_hash},
        "copied_episodes": copied, "planner": planner, "context": rounds["context"],
        "exploration_std": float(rounds["exploration_std"]),
    }
    spec = {**base.spec, "name": round_dataset_name(base.name, index), "episodes": copied + rounds["episodes"],
            "seed": rounds["seed"] + index, "collector": collector}
    return DatasetSpec.from_dict(spec).to_dict()


def plan_rounds(config: Mapping[str, Any], known: dict[str, Dataset], conf: Path | None = None) -> list[Round]:
    """Round 0..count of the pipeline config's ``rounds:`` (empty without one); adds each collected dataset to
    ``known``. PipelineError (one line, naming the key) where the loop cannot run."""
    rounds = config.get("rounds")
    if not rounds:
        return []
    conf = conf or paths.conf_dir()
    experiment = rounds["experiment"]
    if not config.get("control"):
        raise PipelineError("rounds: needs the pipeline config's `control:` section (the closed-loop evaluation "
                            "that scores every round's model on the same held-out seeds)")
    first = Round(0, plan_run(config, experiment, known, conf, key="rounds.experiment"))
    base = first.dataset
    if base.spec["env_id"] not in CONTINUOUS_ACTION_ENVS or base.spec.get("pixels"):
        raise PipelineError(f"rounds: experiment {experiment!r} trains on {base.name} ({base.spec['env_id']}"
                            f"{', pixels' if base.spec.get('pixels') else ''}); collection rounds plan in "
                            f"continuous-action envs from state observations ({', '.join(CONTINUOUS_ACTION_ENVS)})")
    try:
        planner = planner_config(rounds["planner"], list(rounds.get("planner_overrides", [])), conf)
    except PlannerConfigError as err:
        key = "planner" if not (conf / "planner" / f"{rounds['planner']}.yaml").is_file() else "planner_overrides"
        raise PipelineError(f"rounds.{key}: {err}") from None
    found = [first]
    for _ in range(rounds["count"]):
        try:
            spec = collected_spec(rounds, found[-1], base, planner)
        except ValueError as err:
            raise PipelineError(f"rounds: {err}") from None
        dataset = Dataset(spec["name"], spec, spec_hash(spec))
        known[dataset.name] = dataset
        run = plan_run(config, experiment, known, conf, extra=(f"data.name={dataset.name}",), key="rounds.experiment")
        found.append(Round(found[-1].index + 1, run))
    return found


def rounds_id(found: list[Round]) -> str:
    """Directory name of the rounds' summary (``<results>/rounds/<id>``): the runs it compares."""
    return paths.short(canonical_hash({"rounds": [(r.index, r.run.experiment, r.run.run_hash, r.run.eval_hash,
                                                   r.run.control_hash) for r in found]}))
