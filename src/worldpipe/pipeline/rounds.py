"""Data-collection rounds: the collect-train loop of model-based RL as ordinary datasets and runs of the plan.

A pipeline config declares::

    rounds:
      experiment: pendulum_rssm   # the Hydra experiment every round trains
      count: 2                    # collection rounds after round 0
      episodes: 64                # episodes each collection round adds
      seed: 7000                  # round k's episodes are seeded from seed + k
      exploration_std: 0.3        # Gaussian noise on each action, a fraction of the action box's half-width
      novelty_bonus: 0.0          # > 0: the planner also seeks imagined observations far from the data so far
      novelty_reference: 2048     # how many of those observations the bonus measures distance to
      context: 8                  # observed steps the model filters before each decision
      planner: mppi               # conf/planner/<name>.yaml, with planner_overrides
      train_on: union             # union: round k trains on rounds 0..k; latest: on round k's episodes only

Round 0 is the experiment's own run on its declared dataset (the scripted policy's). Round k >= 1 is a dataset
``<base>-round<k>`` collected in the real environment by round k-1's final model
(:mod:`worldpipe.control.collection`), and a run of the same experiment trained on it (``data.name`` set to it, a
new run of the experiment beside round 0's). The collected dataset's spec names round k-1's run by its hash, so
every hash down the chain follows from the config: the DAG is known when the Snakefile is parsed, round k's
identity depends on rounds 0..k only, and raising ``count`` adds rounds without retraining the others.

A loop from scratch (``conf/pipeline/from_scratch.yaml``) starts from a dataset of random actions and adds:

      budget_steps: 1000          # instead of count: as many rounds as fit in this many real env steps (round 0's
                                  # included)
      warm_start: true            # round k >= 1 starts from round k-1's final weights (``+init_from``: identity)
      loop_seeds: [0, 1, 2, 3, 4] # whole loops, each with its own seeds: time-to-quality over loop seeds

Loop seed 0 is the loop as planned without ``loop_seeds``; loop ``s > 0`` trains round 0 on ``<base>-loop<s>`` (the
base dataset's spec with ``seed + s``), every round with ``seed=<s>``, and seeds round k's episodes from
``seed + k + LOOP_SEED_STRIDE * s``. Every loop is evaluated on the base dataset's held-out episodes and the same
closed-loop seeds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from worldpipe.config import paths
from worldpipe.config.planner import PlannerConfigError, planner_config
from worldpipe.core.hashing import canonical_hash
from worldpipe.data.spec import CONTINUOUS_ACTION_ENVS, DatasetSpec, spec_hash
from worldpipe.pipeline.plan import (
    HELDOUT_SUFFIX,
    Dataset,
    PipelineError,
    Run,
    compose_run,
    plan_run,
    planner_value,
)

TRAIN_ON = ("union", "latest")
# Round k of loop s collects from seed rounds.seed + k + LOOP_SEED_STRIDE * s: loops never share a round's seeds.
LOOP_SEED_STRIDE = 1000
LOOP_SUFFIX = "-loop"
NOVELTY_REFERENCE = 2048  # observations the novelty bonus measures distance to, unless novelty_reference says


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


def collected_spec(rounds: Mapping[str, Any], previous: Round, base: Dataset, planner: dict[str, Any],
                   loop_seed: int = 0, value: dict[str, Any] | None = None) -> dict:
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
    if rounds.get("novelty_bonus", 0) > 0:  # absent otherwise: a loop without it keeps its datasets' hashes
        collector["novelty"] = {"weight": float(rounds["novelty_bonus"]),
                                "reference": int(rounds.get("novelty_reference", NOVELTY_REFERENCE))}
    if value is not None:  # the pipeline's `value:`, every setting written out (planner_value)
        collector["value"] = value
    spec = {**base.spec, "name": round_dataset_name(base.name, index), "episodes": copied + rounds["episodes"],
            "seed": rounds["seed"] + index + LOOP_SEED_STRIDE * loop_seed, "collector": collector}
    return DatasetSpec.from_dict(spec).to_dict()


def round_count(rounds: Mapping[str, Any], base: Dataset) -> int:
    """Collection rounds after round 0: ``count``, or as many as ``budget_steps`` real env steps hold (round 0's
    episodes included, every episode counted at its full ``max_steps`` times its ``action_repeat``). PipelineError
    where neither or both."""
    has_count, has_budget = rounds.get("count") is not None, rounds.get("budget_steps") is not None
    if has_count == has_budget:
        raise PipelineError("rounds: give either `count` (collection rounds after round 0) or `budget_steps` (real "
                            f"env steps, round 0's included), not {'both' if has_count else 'neither'}")
    if has_count:
        return int(rounds["count"])
    # Real env steps: an action held for action_repeat control steps is that many steps of the env.
    episode = base.spec["max_steps"] * base.spec.get("action_repeat", 1)
    first = base.spec["episodes"] * episode
    if rounds["budget_steps"] < first:
        raise PipelineError(f"rounds.budget_steps: {rounds['budget_steps']} is less than round 0's {first} steps "
                            f"({base.name}: {base.spec['episodes']} episodes of {episode})")
    return (int(rounds["budget_steps"]) - first) // (int(rounds["episodes"]) * episode)


def loop_seeds(config: Mapping[str, Any]) -> list[int]:
    """The loop seeds of the pipeline config's ``rounds:`` ([0] without ``loop_seeds``; [] without rounds)."""
    rounds = config.get("rounds")
    if not rounds:
        return []
    seeds = list(rounds.get("loop_seeds") or [0])
    if len(set(seeds)) != len(seeds):
        raise PipelineError(f"rounds.loop_seeds: {seeds} names a loop twice")
    return seeds


def plan_rounds(config: Mapping[str, Any], known: dict[str, Dataset], conf: Path | None = None,
                loop_seed: int = 0) -> list[Round]:
    """Round 0..count of the pipeline config's ``rounds:`` (empty without one) for one loop seed; adds each
    dataset it makes to ``known``. PipelineError (one line, naming the key) where the loop cannot run."""
    rounds = config.get("rounds")
    if not rounds:
        return []
    conf = conf or paths.conf_dir()
    experiment = rounds["experiment"]
    if not config.get("control"):
        raise PipelineError("rounds: needs the pipeline config's `control:` section (the closed-loop evaluation "
                            "that scores every round's model on the same held-out seeds)")
    # Composed once: every round's config is this one with other values (data.name, seed, init_from).
    base_cfg = compose_run(config, experiment, conf, key="rounds.experiment")
    first = Round(0, plan_run(config, experiment, known, conf, key="rounds.experiment", base=base_cfg))
    if loop_seed:
        first = Round(0, _loop_run(config, experiment, known, conf, first.dataset, loop_seed, base_cfg))
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
    loop = (f"seed={loop_seed}",) if loop_seed else ()
    for _ in range(round_count(rounds, base)):
        try:
            spec = collected_spec(rounds, found[-1], base, planner, loop_seed, planner_value(config))
        except ValueError as err:
            raise PipelineError(f"rounds: {err}") from None
        dataset = Dataset(spec["name"], spec, spec_hash(spec))
        known[dataset.name] = dataset
        warm = (f"+init_from={experiment}/{found[-1].run.run_hash}",) if rounds.get("warm_start") else ()
        run = plan_run(config, experiment, known, conf, extra=(f"data.name={dataset.name}", *loop, *warm),
                       key="rounds.experiment", heldout=first.run.heldout.name.removesuffix(HELDOUT_SUFFIX),
                       base=base_cfg)
        found.append(Round(found[-1].index + 1, run))
    return found


def _loop_run(config: Mapping[str, Any], experiment: str, known: dict[str, Dataset], conf: Path, base: Dataset,
              loop_seed: int, base_cfg: DictConfig) -> Run:
    """Round 0 of loop ``loop_seed`` > 0: the experiment on ``<base>-loop<s>`` (seed + s), trained with seed=s."""
    if base.spec.get("collector"):
        raise PipelineError(f"rounds.loop_seeds: round 0's dataset {base.name} is itself collected; loops start "
                            "from a declared dataset")
    spec = DatasetSpec.from_dict({**base.spec, "name": f"{base.name}{LOOP_SUFFIX}{loop_seed}",
                                  "seed": base.spec["seed"] + loop_seed}).to_dict()
    dataset = Dataset(spec["name"], spec, spec_hash(spec))
    known[dataset.name] = dataset
    return plan_run(config, experiment, known, conf, extra=(f"data.name={dataset.name}", f"seed={loop_seed}"),
                    key="rounds.experiment", heldout=base.name, base=base_cfg)


def plan_loops(config: Mapping[str, Any], known: dict[str, Dataset], conf: Path | None = None) -> list[list[Round]]:
    """Every loop seed's rounds (see :func:`plan_rounds`), in ``loop_seeds`` order."""
    return [plan_rounds(config, known, conf, seed) for seed in loop_seeds(config)]


def rounds_id(found: list[Round]) -> str:
    """Directory name of the rounds' summary (``<results>/rounds/<id>``): the runs it compares."""
    return paths.short(canonical_hash({"rounds": [(r.index, r.run.experiment, r.run.run_hash, r.run.eval_hash,
                                                   r.run.control_hash) for r in found]}))


def loops_id(loops: list[list[Round]]) -> str:
    """Directory name of the summary across loop seeds (``<results>/rounds/loops-<id>``): the loops it compares."""
    return "loops-" + paths.short(canonical_hash({"loops": [rounds_id(found) for found in loops]}))
