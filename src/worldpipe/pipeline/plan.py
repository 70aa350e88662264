"""The pipeline's plan: which datasets and runs the current pipeline config and `conf/` tree ask for.

The Snakefile builds its DAG from this at parse time. Each experiment's Hydra config is composed with the
pipeline's overrides; the experiment's dataset is the one its composed config names (`data.name`), looked up in
the pipeline config's `datasets:`. A run is identified by the canonical hash of its resolved config (the part a
resume may not change, `worldpipe.config.identity.config_hash`) together with the hash of its dataset's spec; a dataset by
the hash of its spec. Both hashes name directories (worldpipe.config.paths), so an edit anywhere in `conf/`, in the
overrides or in a dataset spec leads to new directories for exactly what it changes.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig

from worldpipe.config import paths
from worldpipe.config.compose import compose_config, value_override, with_values
from worldpipe.config.identity import config_hash, is_resume_safe
from worldpipe.config.tracking_uri import tracking_uri_problem
from worldpipe.config.value import value_settings
from worldpipe.core.errors import UsageError
from worldpipe.core.hashing import canonical_hash
from worldpipe.data.spec import CONTINUOUS_ACTION_ENVS, DatasetSpec, spec_hash
from worldpipe.launch.preflight import check_window, checked_config, validate

HELDOUT_SUFFIX = "-heldout"


class PipelineError(UsageError, ValueError):
    """The pipeline config and the conf/ tree do not fit together; the message names the key."""

@dataclasses.dataclass(frozen=True)
class Dataset:
    """One dataset to generate: its full spec (as `worldpipe data init --spec` takes it) and its hash."""
    name: str
    spec: dict[str, Any]
    spec_hash: str

    @property
    def dir(self) -> str:
        return paths.dataset_dir(self.name, self.spec_hash)


@dataclasses.dataclass(frozen=True)
class Run:
    """One experiment's run under the current config: where it lives and how to start it."""
    experiment: str
    overrides: tuple[str, ...]  # overrides that make its identity: experiment=..., the pipeline's non-safe ones
    config_hash: str
    dataset: Dataset
    heldout: Dataset
    run_hash: str
    eval_hash: str  # the held-out dataset's spec and the evaluation settings: one eval/<eval-hash>/ each
    model: str = ""  # the model's class name (the report labels its plots with it)
    # The closed-loop evaluation's settings (one control/<control-hash>/ each); None: no closed loop for this run
    # (the pipeline config has no `control:`, or the env's actions are discrete).
    control_hash: str | None = None
    seed: int = 0  # the run's `seed`: with the control settings, what its model-free contenders' episodes depend on

    @property
    def dir(self) -> str:
        return paths.run_dir(self.experiment, self.run_hash)


def run_hash(cfg_hash: str, dataset_spec_hash: str) -> str:
    """Identity of a run: its config hash and its training data's spec hash, hashed together."""
    return canonical_hash({"config_hash": cfg_hash, "dataset_spec_hash": dataset_spec_hash})


def compose(overrides: Sequence[str], conf: Path | None = None) -> DictConfig:
    """The resolved training config for these overrides, from `conf` (default: worldpipe.config.paths.conf_dir())."""
    return compose_config(overrides, conf or paths.conf_dir())


def datasets(config: Mapping[str, Any]) -> dict[str, Dataset]:
    """Every dataset the pipeline config declares, and the held-out sibling of each (`<name>-heldout`)."""
    found: dict[str, Dataset] = {}
    for name, entry in config["datasets"].items():
        spec = {key: value for key, value in entry.items() if key != "heldout"}
        train = {"name": name, **spec}
        heldout = {**train, "name": f"{name}{HELDOUT_SUFFIX}", **entry["heldout"]}
        for raw in (train, heldout):
            try:
                full = DatasetSpec.from_dict(raw).to_dict()
            except ValueError as err:
                raise PipelineError(f"datasets: {name}: {err}") from err
            found[full["name"]] = Dataset(full["name"], full, spec_hash(full))
        if train["env_id"].startswith("dm_control/"):  # the key order against the task's, before any job runs
            # start-up: Gymnasium (and dm_control) load at parse time only for a DeepMind Control dataset
            from worldpipe.data.environments import (
                EnvSetupError,
                check_observation_keys,
                make_bare_env,
                observation_keys_of,
            )

            try:
                check_observation_keys(train["env_id"], observation_keys_of(make_bare_env(train["env_id"])),
                                       train.get("observation_keys"))
            except EnvSetupError as err:
                raise PipelineError(f"datasets: {name}: {err}") from None
    return found


def _override_key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def identity_overrides(config: Mapping[str, Any], experiment: str) -> list[str]:
    """The overrides that can change an experiment's config hash: its name and the pipeline's non-safe ones."""
    extra = [o for o in config["train"].get("overrides", []) if not is_resume_safe(_override_key(o))]
    return [f"experiment={experiment}", *extra]


def training_settings(config: Mapping[str, Any], tracking_uri: str) -> list[str]:
    """Overrides every training job gets that a resume may change (world size, records, the pipeline's safe ones).

    They are not part of a run's identity, and the Snakefile hands them to the jobs outside the rule's
    parameters, so changing one (say trainer.log_every) neither names a new run nor makes Snakemake retrain.
    """
    train = config["train"]
    safe = [o for o in train.get("overrides", []) if is_resume_safe(_override_key(o))]
    return [f"parallel.nproc_per_node={train['nproc_per_node']}", f"parallel.nnodes={train.get('nnodes', 1)}",
            value_override("tracking.uri", tracking_uri), *safe]


def plan_run(config: Mapping[str, Any], experiment: str, known: Mapping[str, Dataset],
             conf: Path | None = None, extra: Sequence[str] = (), key: str = "experiments",
             heldout: str | None = None, base: DictConfig | None = None) -> Run:
    """Compose one experiment's config and address its run; PipelineError names what does not fit.

    ``extra``: further identity overrides (a collection round's ``data.name``). ``key``: the pipeline config's key
    that names the experiment, as refusals name it (``experiments``, ``rounds.experiment``). ``heldout``: the
    dataset whose held-out sibling evaluates the run (default: its own, or its collection's round 0's).
    ``base``: the experiment's config as :func:`compose_run` composed it; ``extra`` must then be plain values,
    set on a copy of it instead of composing again (a loop's rounds).
    """
    overrides = [*identity_overrides(config, experiment), *extra]
    conf = conf or paths.conf_dir()
    try:
        # Validated (types, ranges, layout against world size) with the settings too, so a bad value stops the
        # pipeline while the Snakefile is parsed, before any data stage runs; the settings cannot change the hash.
        # A pass is remembered: later parses with the same config and code skip importing torch for it.
        everything = [*overrides, *training_settings(config, "")]
        if base is None:
            cfg = checked_config(everything, conf, remember_pass=True)
        else:
            cfg = with_values(base, extra, conf)
            validate(cfg, everything, conf, remember_pass=True)
    except Exception as err:  # noqa: BLE001 - Hydra and OmegaConf raise many types; all are config errors
        raise _not_composed(config, experiment, key, err) from None
    name = str(cfg.data.name)
    if name not in known or name.endswith(HELDOUT_SUFFIX):
        raise PipelineError(f"{key}: {experiment!r} trains on data.name={name!r}, which is not under "
                            f"datasets: (declared: {sorted(n for n in known if not n.endswith(HELDOUT_SUFFIX))})")
    dataset = known[name]
    # A collection round is evaluated on its round 0's held-out episodes: every round on the same ones.
    heldout = known[(heldout or (dataset.spec.get("collector") or {}).get("base", name)) + HELDOUT_SUFFIX]
    try:
        check_window(cfg, dataset.spec.get("max_steps"), f"dataset {name!r} (datasets: {name}: max_steps)")
    except UsageError as err:
        raise PipelineError(f"{key}: experiment {experiment!r}: {err}") from None
    cfg_hash = config_hash(cfg)
    evaluation = canonical_hash({"heldout_spec_hash": heldout.spec_hash, **config["evaluate"]})
    return Run(experiment, tuple(overrides), cfg_hash, dataset, heldout, run_hash(cfg_hash, dataset.spec_hash),
               evaluation, str(cfg.model.get("_target_", "")).rsplit(".", 1)[-1], control_hash(config, dataset, conf),
               int(cfg.seed))


def _not_composed(config: Mapping[str, Any], experiment: str, key: str, err: Exception) -> PipelineError:
    message = "; ".join(line.strip() for line in str(err).splitlines() if line.strip())
    return PipelineError(f"{key}: experiment {experiment!r} does not compose with overrides "
                         f"{list(config['train'].get('overrides', []))}: {message}")


def compose_run(config: Mapping[str, Any], experiment: str, conf: Path | None = None,
                key: str = "experiments") -> DictConfig:
    """The experiment's checked config under the pipeline's overrides, composed once for :func:`plan_run`'s
    ``base`` (the runs that differ from it only in values); PipelineError as :func:`plan_run` words it."""
    overrides = identity_overrides(config, experiment)
    try:
        return checked_config([*overrides, *training_settings(config, "")], conf or paths.conf_dir(),
                              remember_pass=True)
    except Exception as err:  # noqa: BLE001 - Hydra and OmegaConf raise many types; all are config errors
        raise _not_composed(config, experiment, key, err) from None


def control_settings(config: Mapping[str, Any], dataset: Dataset) -> dict[str, Any] | None:
    """What a run's closed-loop evaluation runs with (the env and policy of its training data and the pipeline's
    `control:`), None where there is none: no `control:` section, or an env with discrete actions."""
    control = config.get("control")
    if not control or dataset.spec["env_id"] not in CONTINUOUS_ACTION_ENVS:
        return None
    settings = {"env_id": dataset.spec["env_id"], "behaviour_policy": dataset.spec["policy"],
                "max_steps": dataset.spec["max_steps"], **control}
    value = planner_value(config)
    if value is not None:  # absent otherwise: an evaluation without one keeps its control hash
        settings["value"] = value
    return settings


def planner_value(config: Mapping[str, Any]) -> dict[str, Any] | None:
    """The pipeline config's ``value:`` (the terminal value every planner with a learned model adds past its
    horizon: collection rounds and closed-loop evaluation) with every setting written out; None without one.
    PipelineError naming the setting that is wrong."""
    block = config.get("value")
    if block is None:
        return None
    try:
        return value_settings(block, "value")
    except ValueError as err:
        raise PipelineError(str(err)) from None


def control_hash(config: Mapping[str, Any], dataset: Dataset, conf: Path | None = None) -> str | None:
    """The directory name of a run's closed-loop evaluation: a hash of its settings and of the planner's config
    file (``conf/planner/<planner>.yaml``), so an edit of either evaluates again beside the earlier result."""
    settings = control_settings(config, dataset)
    if settings is None:
        return None
    planner = (conf or paths.conf_dir()) / "planner" / f"{settings['planner']}.yaml"
    try:
        planner_config = yaml.safe_load(planner.read_text())
    except (OSError, yaml.YAMLError) as err:
        known = sorted(p.stem for p in planner.parent.glob("*.yaml"))
        raise PipelineError(f"control: planner: {settings['planner']!r}: cannot read {planner} "
                            f"({type(err).__name__}; planners: {', '.join(known)})") from None
    return canonical_hash({**settings, "planner_config": planner_config})


def check_tracking_uri(config: Mapping[str, Any]) -> None:
    """The pipeline's ``tracking_uri`` (else $MLFLOW_TRACKING_URI) is a well-formed tracking URI; PipelineError."""
    key, uri = "tracking_uri", config.get("tracking_uri") or ""
    if not uri:
        key, uri = "$MLFLOW_TRACKING_URI (tracking_uri is empty)", os.environ.get("MLFLOW_TRACKING_URI", "")
    problem = tracking_uri_problem(uri)
    if problem:
        raise PipelineError(f"{key}: {problem}")


def plan(config: Mapping[str, Any], conf: Path | None = None) -> tuple[dict[str, Dataset], dict[str, Run]]:
    """Datasets declared and the current run of every experiment, in the pipeline config's order."""
    check_tracking_uri(config)
    known = datasets(config)
    runs = {experiment: plan_run(config, experiment, known, conf) for experiment in config["experiments"]}
    return known, runs


def launch_overrides(run: Run) -> list[str]:
    """The overrides that make a run: its identity ones, then where it and its data live (fixed by the hashes)."""
    return [*run.overrides, f"run_dir={run.dir}", f"data.store={run.dataset.dir}/{paths.STORE_NAME}",
            f"data.manifest={run.dataset.dir}/{paths.MANIFEST_NAME}"]


def comparison_id(runs: Mapping[str, Run], control: bool = False) -> str:
    """Directory name of a comparison of these runs' evaluations (``control``: their closed-loop ones): an edit
    and its undo return to the same name."""
    evaluation = (lambda r: r.control_hash) if control else (lambda r: r.eval_hash)
    return paths.short(canonical_hash({"runs": sorted((r.experiment, r.run_hash, evaluation(r)) for r in runs.values())}))


def _pipeline_configs(conf: Path, experiment: str | None) -> list[tuple[Path, dict[str, Any]]]:
    """conf/pipeline/*.yaml, those that train ``experiment`` first, then default.yaml, then by name."""
    from omegaconf import OmegaConf

    found = []
    for file in sorted((conf / "pipeline").glob("*.yaml")):
        config = OmegaConf.to_container(OmegaConf.load(file), resolve=True)
        if isinstance(config, dict) and isinstance(config.get("datasets"), dict):
            found.append((file, config))

    def rank(item: tuple[Path, dict[str, Any]]) -> tuple[int, int]:
        file, config = item
        trained = [*(config.get("experiments") or []), (config.get("sweep") or {}).get("experiment")]
        return (0 if experiment in trained else 1, 0 if file.stem == "default" else 1)

    return sorted(found, key=rank)


def locate_dataset(name: str, experiment: str | None, conf: Path | None = None) -> Dataset:
    """The built dataset ``name`` as the pipeline addresses it: by the spec hash of its `datasets:` entry.

    The pipeline configs that train ``experiment`` are asked first, then conf/pipeline/default.yaml, then the
    others; the first whose dataset directory holds a manifest wins. PipelineError (one line) says which
    command builds the dataset when none is built, or where to declare it when no pipeline config does.
    """
    conf = conf or paths.conf_dir()
    declared: list[tuple[Path, Dataset]] = []
    for file, config in _pipeline_configs(conf, experiment):
        if name in config["datasets"]:
            dataset = datasets(config)[name]
            if (Path(dataset.dir) / paths.MANIFEST_NAME).is_file():
                return dataset
            declared.append((file, dataset))
    if not declared:
        raise PipelineError(f"config key 'data.name': dataset {name!r} is declared in no conf/pipeline/*.yaml "
                            "(datasets:); declare it there beside an experiment that trains on it and build it "
                            "with `snakemake --cores 2 --configfile FILE --until seal_dataset`, or pass "
                            "data.store=... data.manifest=...")
    file, dataset = declared[0]
    raise PipelineError(f"config key 'data.manifest': dataset {name!r} (spec of {_relative(file)}) is not built "
                        f"at {dataset.dir}; build it with `snakemake --cores 2 --configfile {_relative(file)} "
                        "--until seal_dataset`, or pass data.store=... data.manifest=...")


def _relative(file: Path) -> str:
    try:
        return str(file.relative_to(Path.cwd()))
    except ValueError:
        return str(file)
