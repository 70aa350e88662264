"""Closed-loop evaluation: what an agent achieves in the real environment with a trained world model.

On held-out episode seeds (``episode_seeds(seed, i)``, the data pipeline's own derivation under a seed no dataset
uses) four contenders act, each on the same seeds:

    random        uniform random actions: the floor
    behaviour     the scripted policy that collected the training data
    planner       the configured planner with the trained model as its simulator
    ceiling       the same planner with the true simulator as its model, at the budget more compute cannot beat
                  (``settings.ceiling``, measured by :mod:`worldpipe.control.yardstick`)

Returns are summarised as mean with a 95% confidence interval (Student t over episodes) and as the normalised
score ``(R - R_random) / (R_ceiling - R_random)``, every contender on the same scale, beside the env's best known
return. The planner's control loop is timed per real step, by part (:mod:`worldpipe.control.episodes`), against the
environment's control period; with ``http_episodes`` the planner also plays its first episodes with the model behind
``worldpipe serve``: a latency probe of the loop over HTTP (and a check that it takes the same actions), not a
contender.

Everything an evaluation depends on is in its result (checkpoint step and digest, settings, seeds, streams), and
every episode records the SHA-256 of its actions, so :func:`rerun_control` repeats it from the record alone and
compares bit for bit.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from worldpipe.checkpoint import CheckpointManager, state_digest
from worldpipe.checkpoint.layout import Location
from worldpipe.control.dynamics import ControlError, LearnedDynamics, ServedDynamics, true_simulator
from worldpipe.control.episodes import PARTS, PlannerAgent, PolicyAgent, run_episode
from worldpipe.control.planners import Planner
from worldpipe.control.report import write_episode_gif
from worldpipe.control.served import served_model
from worldpipe.control.value import VALUE_DIR, TerminalValue, ValueShare, fitted_value
from worldpipe.data.environments import make_bare_env
from worldpipe.data.episodes import episode_seeds
from worldpipe.data.policies import get_policy
from worldpipe.evaluate.open_loop import load_model
from worldpipe.measure.energy import EnergyMeter
from worldpipe.rollout.streams import StreamId

CONTENDERS = ("random", "behaviour", "planner", "ceiling")
# The contenders that do not act with the run's model: their episodes depend on the settings and the run's seed
# only, so the runs that share both (a loop's rounds; experiments on the same data and seed) share one evaluation of
# them (:func:`evaluate_references`). The ceiling's true-simulator rollouts are most of an evaluation's time.
MODEL_FREE = ("random", "behaviour", "ceiling")
# The planner with the model behind `worldpipe serve` (settings.http_episodes): a latency probe, not a contender.
HTTP_CONTENDER = "planner_http"
HTTP_PROBE = "http_probe"
STREAM_PREFIX = "control"


@dataclass(frozen=True)
class ControlSettings:
    """What a closed-loop evaluation runs: the env and its behaviour policy, the held-out seeds, the planner."""

    env_id: str
    behaviour_policy: str
    max_steps: int
    episodes: int
    seed: int
    context: int
    planner: dict[str, Any] = field(default_factory=dict)  # a planner config with its _target_
    # Episodes the planner also plays through `worldpipe serve` (one HTTP request per planner iteration), on the
    # first seeds: the control loop with transport, and whether it takes the in-process planner's actions.
    http_episodes: int = 0
    # The ceiling's planner config: the planner's own at the budget the yardstick chose (empty: the planner's, as
    # records written before the yardstick had one).
    ceiling: dict[str, Any] = field(default_factory=dict)
    # How the env is made beyond its id, as the training data's spec says (DeepMind Control: each action held for
    # action_repeat control steps; the dict observation flattened in observation_keys order).
    action_repeat: int = 1
    observation_keys: list | None = None
    # The planner's terminal value, fitted through the run's model on its training data (every ValueSettings
    # field; None: the planner sees its horizon only). The ceiling plans without one.
    value: dict[str, Any] | None = None

    @property
    def env_options(self) -> dict[str, Any]:
        """``make_env``'s keywords beyond the env id."""
        return {"action_repeat": self.action_repeat, "observation_keys": self.observation_keys}


# Published returns of well-tuned agents (mean ± std over their evaluation episodes), beside the ceiling.
BEST_KNOWN: dict[str, dict[str, Any]] = {
    "Pendulum-v1": {
        "return": -150.0,
        "source": "rl-baselines3-zoo benchmark table (TD3 -152 ± 90, SAC -157 ± 89)",
        "agents": {"TD3": {"mean": -152.0, "std": 90.0}, "SAC": {"mean": -157.0, "std": 89.0}},
    },
    # DeepMind Control: 1,000 control steps an episode, each worth at most 1 (returns in [0, 1000]).
    "dm_control/cartpole-swingup-v0": {
        "return": 845.0,
        "source": "DreamerV3, from pixels: about 845 after 500k env steps (615 after 100k); from state is easier",
        "agents": {"DreamerV3 (pixels, 500k steps)": {"mean": 845.0}, "DreamerV3 (pixels, 100k steps)": {"mean": 615.0}},
    },
    "dm_control/pendulum-swingup-v0": {
        "return": 724.0,
        "source": "TD-MPC2 published results, from state: 724 after 100k env steps (3 seeds)",
        "agents": {"TD-MPC2 (state, 100k steps)": {"mean": 724.0}},
    },
}


def best_known(env_id: str) -> dict[str, Any] | None:
    """The best return known for ``env_id`` and where it comes from, None where the project has none."""
    known = BEST_KNOWN.get(env_id)
    return None if known is None else dict(known)


def score(value: float, floor: float, ceiling: float) -> tuple[float | None, str | None]:
    """(R - R_floor) / (R_ceiling - R_floor) and None, or None and why there is no score (floor meets ceiling)."""
    span = ceiling - floor
    if abs(span) < 1e-9:
        return None, (f"no score: the ceiling's mean return ({ceiling:.6g}) equals random's ({floor:.6g}), so the "
                      "scale has no length; more episodes or a longer episode separate them")
    return (value - floor) / span, None


def build_planner(config: dict[str, Any], low: float, high: float) -> Planner:
    """The planner a config names (``_target_`` plus its settings), acting in [low, high]."""
    from hydra.utils import instantiate  # start-up: Hydra's instantiate only where a planner is built

    planner = instantiate(dict(config))
    if not isinstance(planner, Planner):
        raise ControlError(f"planner _target_ {config.get('_target_')!r} is not a worldpipe planner")
    return planner.bounded(low, high)


def action_box(env_id: str) -> tuple[float, float]:
    """The env's (low, high) action bound; ControlError for a discrete action space (planners sample boxes)."""
    env = make_bare_env(env_id)
    try:
        space = env.action_space
        if not hasattr(space, "low"):
            raise ControlError(f"{env_id} has discrete actions; the planners sample continuous action boxes")
        return float(np.min(space.low)), float(np.max(space.high))
    finally:
        env.close()


def control_period_s(env_id: str, action_repeat: int = 1) -> float | None:
    """Seconds of simulated time per decision (Pendulum: dt 0.05; DeepMind Control: its control step times the
    action repeat), None where the env does not say."""
    env = make_bare_env(env_id)
    try:
        for name in ("dt", "tau"):
            value = getattr(env.unwrapped, name, None)
            if isinstance(value, int | float):
                return float(value) * action_repeat
        return None
    finally:
        env.close()


def summarize(returns: list[float]) -> dict[str, Any]:
    """Mean, sample std and the 95% confidence interval of the mean (Student t) of episode returns."""
    from scipy import stats  # start-up: SciPy loads only to summarise returns

    values = np.asarray(returns, dtype=np.float64)
    mean = float(values.mean())
    if len(values) < 2:
        return {"mean": mean, "std": 0.0, "ci95": [mean, mean], "episodes": len(values)}
    half = float(stats.t.ppf(0.975, len(values) - 1) * values.std(ddof=1) / np.sqrt(len(values)))
    return {"mean": mean, "std": float(values.std(ddof=1)), "ci95": [mean - half, mean + half],
            "episodes": len(values)}


def normalised_score(value: float, random: float, ceiling: float) -> float | None:
    """(R - R_random) / (R_ceiling - R_random): 0 is random, 1 the ceiling; None if they tie (see :func:`score`)."""
    return score(value, random, ceiling)[0]


def loop_split(timings: list[dict[str, list[float]]], period_s: float | None) -> dict[str, Any]:
    """p50/p99 per part of the control loop (ms) over every real step, and whether decisions keep real time.

    A decision is everything before actuation; it keeps real time when its p99 fits in the control period.
    """
    parts = {part: np.concatenate([np.asarray(t[part]) for t in timings]) * 1000 for part in PARTS}
    decision = sum(parts[p] for p in PARTS if p != "actuation")
    split = {part: {"p50_ms": float(np.percentile(v, 50)), "p99_ms": float(np.percentile(v, 99))}
             for part, v in parts.items()}
    out = {"parts": split, "decision_p50_ms": float(np.percentile(decision, 50)),
           "decision_p99_ms": float(np.percentile(decision, 99)), "steps": int(decision.size),
           "period_ms": None if period_s is None else period_s * 1000}
    out["keeps_real_time"] = None if period_s is None else out["decision_p99_ms"] <= period_s * 1000
    out["within_period_fraction"] = None if period_s is None else float(np.mean(decision <= period_s * 1000))
    return out


def _dynamics(name: str, settings: ControlSettings, model, url: str | None, planner: Planner,
              value: TerminalValue | None):
    if name == "planner":
        return LearnedDynamics(model, settings.context, value, planner.discount)
    if name == HTTP_CONTENDER:
        return ServedDynamics(url, settings.context, model.act_dim)
    return true_simulator(settings.env_id, settings.env_options)


def _agent(name: str, settings: ControlSettings, model, box: tuple[float, float], run_seed: int, episode: int,
           url: str | None = None, value: TerminalValue | None = None):
    if name in ("random", "behaviour"):
        policy = "random" if name == "random" else settings.behaviour_policy
        return PolicyAgent(get_policy(settings.env_id, policy))
    # Over HTTP the planner draws what it draws in-process: the same stream, so the same actions if the bits agree.
    stream_name = "planner" if name == HTTP_CONTENDER else name
    stream = StreamId(run_seed, f"{STREAM_PREFIX}/{stream_name}/{settings.seed}/{episode}")
    planner = build_planner((settings.ceiling or settings.planner) if name == "ceiling" else settings.planner, *box)
    return PlannerAgent(planner, _dynamics(name, settings, model, url, planner, value), stream)


def run_contender(name: str, settings: ControlSettings, model, run_seed: int, pixel_size: int | None = None,
                  url: str | None = None, value: TerminalValue | None = None) -> dict[str, Any]:
    """Every held-out episode of one contender: returns, action hashes, timings and energy (``value``: the
    planner's terminal value with the run's model)."""
    box = action_box(settings.env_id)
    meter = EnergyMeter()
    meter.start()
    episodes = []
    count = settings.http_episodes if name == HTTP_CONTENDER else settings.episodes
    for i in range(count):
        reset_seed, rng = episode_seeds(settings.seed, i)
        agent = _agent(name, settings, model, box, run_seed, i, url, value)
        sees_pixels = pixel_size if name in ("planner", HTTP_CONTENDER) else None
        if name == "planner" and pixel_size is not None and i == 0:
            agent.record_imagined = True  # the episode the GIF shows
        episodes.append(run_episode(settings.env_id, settings.max_steps, reset_seed, rng, agent, sees_pixels,
                                    settings.env_options))
    steps = sum(e.length for e in episodes)
    energy = meter.stop(rollouts=count, actions=steps)
    return {
        "returns": [e.episode_return for e in episodes],
        "actions_sha256": [e.actions_sha256 for e in episodes],
        "steps": steps,
        "timings": [e.timings for e in episodes],
        "energy": energy,  # per action where RAPL or NVML exists; otherwise the reason none does
        "pictured": (episodes[0].frames, episodes[0].imagined) if episodes and episodes[0].imagined else None,
    }


def pixel_size_of(model) -> int | None:
    """The square frame size a pixel model observes (obs_dim = size*size*3), None for a state model."""
    if model.observation_key != "pixels":
        return None
    return int(round((model.obs_dim // 3) ** 0.5))


@contextmanager
def long_lived_heap_frozen() -> Iterator[None]:
    """Keep what is loaded before the episodes (torch, the model, SciPy, MLflow) out of the garbage collector's
    full collections while they run, and give it back after.

    A full collection walks every tracked object; with the whole heap in view it pauses one decision of the
    control loop far beyond the environment's period, a tail that measures the collector, not the planner.
    """
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _prepare(settings: ControlSettings) -> None:
    """Refuse empty settings; one thread, so that a decision's bits do not depend on how many cores there are."""
    if settings.episodes < 1 or settings.max_steps < 1:
        raise ControlError("control episodes and max_steps must be >= 1")
    if settings.value is not None and settings.http_episodes > 0:
        raise ControlError("control http_episodes with a planner value: a served model has no value to plan with "
                           "(http_episodes: 0)")
    torch.set_num_threads(1)


def evaluate_references(settings: ControlSettings, run_seed: int) -> dict[str, Any]:
    """The model-free contenders (:data:`MODEL_FREE`) on the held-out seeds of a run with seed ``run_seed``: what
    :func:`evaluate_control` takes as ``references`` for every run with these settings and that seed."""
    _prepare(settings)
    with long_lived_heap_frozen():
        contenders = {name: run_contender(name, settings, None, run_seed) for name in MODEL_FREE}
    for contender in contenders.values():
        del contender["pictured"]  # only the planner's episodes are pictured
    return {"settings": settings_record(settings), "run_seed": run_seed, "contenders": contenders}


def check_references(references: dict[str, Any], settings: ControlSettings, run_seed: int) -> None:
    """The references were made with these settings and this run seed, else ControlError naming what differs."""
    made = references.get("settings") or {}
    wanted = settings_record(settings)
    differing = sorted(key for key in made.keys() | wanted.keys() if made.get(key) != wanted.get(key))
    if differing:
        raise ControlError(f"the references were evaluated with other settings ({', '.join(differing)}: "
                           f"{[made.get(k) for k in differing]} there, {[wanted.get(k) for k in differing]} here)")
    if references.get("run_seed") != run_seed:
        raise ControlError(f"the references were evaluated for run seed {references.get('run_seed')}, the run's "
                           f"seed is {run_seed}")


def evaluate_control(checkpoints: str, settings: ControlSettings, step: int | None = None,
                     gif: str | None = None, references: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run every contender on the held-out seeds; the result :func:`rerun_control` can repeat.

    ``gif``: where a pixel model's first planned episode goes as a GIF (true frames beside imagined ones).
    ``references``: the model-free contenders' episodes from :func:`evaluate_references` with the same settings and
    the run's seed (checked; ControlError otherwise), played here only where not given.
    """
    _prepare(settings)
    model, identity = load_model(checkpoints, step)
    model.eval()
    digest = state_digest(CheckpointManager(checkpoints).load(identity["step"]))
    run_seed = int(identity["config"].get("seed", 0))
    if references is not None:
        check_references(references, settings, run_seed)
    given = {} if references is None else references["contenders"]
    value, value_s = None, None
    if settings.value is not None:
        started, box = time.perf_counter(), action_box(settings.env_id)
        share = ValueShare(str(Path(checkpoints).parent / VALUE_DIR), digest) if Path(checkpoints).is_dir() else None
        value = fitted_value(model, identity["config"], settings.value, build_planner(settings.planner, *box),
                             settings.context, box, share)
        value_s = time.perf_counter() - started
    with long_lived_heap_frozen():
        contenders = {name: given[name] if name in given else
                      run_contender(name, settings, model, run_seed, pixel_size_of(model), value=value)
                      for name in CONTENDERS}
        if settings.http_episodes > 0:
            with served_model(Location(checkpoints, identity["step"]).path) as url:  # the step evaluated here
                contenders[HTTP_CONTENDER] = run_contender(HTTP_CONTENDER, settings, model, run_seed,
                                                           pixel_size_of(model), url)
    result = control_result(settings, identity, digest, run_seed, contenders)
    if value_s is not None:
        result["value_fit_s"] = value_s  # part of the evaluation's wall-clock, not of any decision
    if gif is not None and write_episode_gif(contenders["planner"]["pictured"], pixel_size_of(model), gif):
        result["pictures"] = [gif]
    return result


def control_result(settings: ControlSettings, identity: dict, digest: str, run_seed: int,
                   contenders: dict[str, dict]) -> dict[str, Any]:
    """The JSON record of an evaluation: settings, identity, per-contender returns, summaries and scores on the
    yardstick, the loop split, and the HTTP latency probe where one ran."""
    contenders = dict(contenders)
    probe = contenders.pop(HTTP_CONTENDER, None)
    summaries = {name: summarize(c["returns"]) for name, c in contenders.items()}
    floor, ceiling = summaries["random"]["mean"], summaries["ceiling"]["mean"]
    period = control_period_s(settings.env_id, settings.action_repeat)
    out = {
        "settings": settings_record(settings),
        "model": identity.get("config", {}).get("model", {}).get("_target_", "").rsplit(".", 1)[-1],
        "experiment": identity.get("config", {}).get("experiment_name"),
        "checkpoint_step": identity["step"],
        "checkpoint_digest": digest,
        "mlflow_run_id": identity.get("mlflow_run_id"),
        "run_seed": run_seed,
        "contenders": {},
    }
    for name, c in contenders.items():
        out["contenders"][name] = {
            **summaries[name],
            "score": score(summaries[name]["mean"], floor, ceiling)[0],
            "returns": c["returns"], "actions_sha256": c["actions_sha256"], "energy": c["energy"],
            "control_loop": loop_split(c["timings"], period),
        }
    out["score"] = out["contenders"]["planner"]["score"]
    out["ceiling_score"] = out["contenders"]["ceiling"]["score"]
    out["behaviour_score"] = out["contenders"]["behaviour"]["score"]
    out["yardstick"] = yardstick_record(settings, floor, ceiling)
    if probe is not None:
        served = probe["actions_sha256"]
        out["http_takes_the_in_process_actions"] = served == contenders["planner"]["actions_sha256"][:len(served)]
        out[HTTP_PROBE] = {
            "episodes": len(served), "returns": probe["returns"], "actions_sha256": served,
            "takes_the_in_process_actions": out["http_takes_the_in_process_actions"], "energy": probe["energy"],
            "control_loop": loop_split(probe["timings"], period),
        }
    return out


def yardstick_record(settings: ControlSettings, floor: float, ceiling: float) -> dict[str, Any]:
    """What the scores are measured against: the floor and ceiling returns, the ceiling's budget, why there is no
    score where they tie, and the env's best known return on the same scale."""
    planner = settings.ceiling or settings.planner
    _, reason = score(ceiling, floor, ceiling)
    record = {"score": "(R - R_random) / (R_ceiling - R_random)", "floor_return": floor, "ceiling_return": ceiling,
              "ceiling_budget": {key: planner.get(key) for key in ("samples", "iterations", "horizon")},
              "no_score_reason": reason, "best_known": best_known(settings.env_id)}
    if record["best_known"] is not None:
        record["best_known"]["score"] = score(record["best_known"]["return"], floor, ceiling)[0]
    return record


def settings_record(settings: ControlSettings) -> dict[str, Any]:
    """The settings as recorded: the env options only where they are not the defaults (a flat-observation env's
    record reads as it did before they existed)."""
    record = asdict(settings)
    for key, default in (("action_repeat", 1), ("observation_keys", None), ("value", None)):
        if record[key] == default:
            del record[key]
    return record


def settings_from_record(record: dict[str, Any]) -> ControlSettings:
    """The settings a recorded evaluation ran with."""
    return ControlSettings(**record["settings"])


def rerun_control(checkpoints: str, record: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Repeat a recorded evaluation from its record alone; the new result and every difference (empty: the
    same bits — the same checkpoint digest, returns and actions, episode by episode)."""
    result = evaluate_control(checkpoints, settings_from_record(record), step=int(record["checkpoint_step"]))
    return result, record_differences(record, result)


def record_differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """What differs between two evaluation records in what must repeat bit for bit."""
    differences = []
    if old["checkpoint_digest"] != new["checkpoint_digest"]:
        differences.append(f"checkpoint digest: recorded {old['checkpoint_digest'][:16]}, "
                           f"now {new['checkpoint_digest'][:16]}")
    for name, then in old["contenders"].items():
        if name == HTTP_CONTENDER:  # a record from before the HTTP run became a probe: compared as the probe
            continue
        now = new["contenders"].get(name, {})
        for i, (a, b) in enumerate(zip(then["actions_sha256"], now.get("actions_sha256", []), strict=False)):
            if a != b:
                differences.append(f"{name} episode {i}: actions differ (return {then['returns'][i]!r} "
                                   f"recorded, {now['returns'][i]!r} now)")
                break
        if then["returns"] != now.get("returns"):
            differences.append(f"{name}: returns differ")
    served = (old.get(HTTP_PROBE) or old["contenders"].get(HTTP_CONTENDER) or {}).get("actions_sha256")
    if served is not None and served != new.get(HTTP_PROBE, {}).get("actions_sha256"):
        differences.append(f"{HTTP_PROBE}: actions over HTTP differ")
    return differences
