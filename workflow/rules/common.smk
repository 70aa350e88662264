# The plan the rules are built from, and helpers shared by the rules. No rules here.
#
# Parse time: every experiment's Hydra config is composed from this checkout's conf/ with the pipeline's
# overrides (worldpipe.pipeline.plan); its run directory is named by the hash of that resolved config and of its
# dataset's spec, and each dataset directory by the hash of its spec (worldpipe.config.paths). Editing conf/ or the
# pipeline config therefore names new directories for exactly the experiments it changes.
import json
import math
import os
import re
import shlex
import sys
from pathlib import Path

from snakemake.exceptions import WorkflowError

# Before worldpipe is imported: worldpipe.config.paths reads the conf/ tree's location once, and it must be the one beside
# this Snakefile (the run hashes, the parse-time validation and the jobs all read it). The only variable set here:
# jobs inherit it (a SLURM job sets it again when it reads this file), so they and their training read the conf/
# tree the run hashes come from. It is no parameter of the rules: moving the checkout must not retrain anything.
CONF_DIR = os.path.join(workflow.basedir, "conf")
os.environ.update({"WORLDPIPE_CONF_DIR": CONF_DIR})

from worldpipe.config import paths
from worldpipe.launch import slurm
from worldpipe.pipeline.sweep import format_value, sweep_targets
from worldpipe.pipeline import report_config
from worldpipe.pipeline.config_check import refuse
from worldpipe.pipeline.rounds import loops_id, plan_loops, rounds_id
from worldpipe.pipeline.plan import (
    PipelineError,
    comparison_id,
    control_settings,
    launch_overrides,
    plan,
    training_settings,
)

if paths.CONF_DIR != Path(CONF_DIR).resolve():
    raise WorkflowError(f"worldpipe was imported before {paths.CONF_DIR_ENV} was set: it reads {paths.CONF_DIR}")
PATHS = paths.layout(Path(CONF_DIR))
RESULTS, DATA, RUNS, LOGS, RULE_BENCHMARKS = (
    PATHS[key] for key in ("results", "data", "runs", "logs", "rule_benchmarks")
)
# `snakemake --report` that names no config renders what the last successful run made: that run's whole config,
# recorded by the Snakefile's onsuccess (worldpipe.pipeline.report_config). Snakemake's own argv is the only
# place that says a report, not a run, is asked for while this file is parsed.
try:
    RECORDED_CONFIG = report_config.config_to_render(
        sys.argv, bool(workflow.overwrite_configfiles or workflow.config_settings.config), PATHS["pipeline_config"]
    )
except report_config.ReportConfigError as err:
    raise WorkflowError(str(err)) from None
if RECORDED_CONFIG is not None:
    config.clear()
    config.update(RECORDED_CONFIG)
# Every experiment's training config (with the pipeline's overrides) is composed and validated now, while the
# Snakefile is parsed: a bad value stops the pipeline before the data stages run.
try:
    DATASETS, RUNS_PLANNED = plan(config, Path(CONF_DIR))
    # Collection rounds (config `rounds`), one loop per loop seed: their datasets join DATASETS; loop seed 0's round 0
    # is the experiment's own run.
    LOOPS = plan_loops(config, DATASETS, Path(CONF_DIR))
except PipelineError as err:
    refuse(f"pipeline config: {err}")
# Every run the DAG may train, by experiment and short run hash: the experiments' current runs and the rounds'.
RUNS_BY_HASH = {
    (run.experiment, paths.short(run.run_hash)): run
    for run in [*RUNS_PLANNED.values(), *(r.run for found in LOOPS for r in found)]
}

HASH_PATTERN = f"[0-9a-f]{{{paths.HASH_CHARS}}}"


wildcard_constraints:
    dataset="|".join(re.escape(name) for name in sorted(DATASETS)),
    spec_hash=HASH_PATTERN,
    run_hash=HASH_PATTERN,
    eval_hash=HASH_PATTERN,
    control_hash=HASH_PATTERN,
    run_seed=r"\d+",
    experiment="|".join(re.escape(name) for name in sorted({experiment for experiment, _ in RUNS_BY_HASH})),


def dataset_of(wildcards):
    """The declared dataset a {dataset}/{spec_hash} target stands for; only the current spec is built."""
    dataset = DATASETS[wildcards.dataset]
    if paths.short(dataset.spec_hash) != wildcards.spec_hash:
        raise WorkflowError(
            f"{DATA}/{wildcards.dataset}/{wildcards.spec_hash} is not the current spec of {wildcards.dataset} "
            f"({paths.short(dataset.spec_hash)}): earlier datasets are kept, not rebuilt"
        )
    return dataset


def run_of(wildcards):
    """The planned run a {experiment}/{run_hash} target stands for; only the current config's runs train."""
    run = RUNS_BY_HASH.get((wildcards.experiment, wildcards.run_hash))
    if run is None:
        current = sorted(h for e, h in RUNS_BY_HASH if e == wildcards.experiment)
        raise WorkflowError(
            f"{RUNS}/{wildcards.experiment}/{wildcards.run_hash} is not a current config's run of "
            f"{wildcards.experiment} ({', '.join(current)}): earlier runs are kept, not retrained"
        )
    return run


def run_labels(wildcards, figure):
    """The report's labels of a run's plot, in its experiment's category (one level: two clicks to any plot)."""
    return {"figure": figure, "model": run_of(wildcards).model, "run": wildcards.run_hash}


def point_labels(point):
    """The report's labels of a sweep point's plot (sweep.smk): its name, the figure, and each swept value."""
    values = {key: format_value(value) for key, value in SWEEP_POINTS[point].values}
    return {"point": point, "figure": "error vs horizon"} | values


def dataset_file(rule_output, dataset):
    """A data rule's output pattern filled in for one dataset."""
    return rule_output.format(dataset=dataset.name, spec_hash=paths.short(dataset.spec_hash))


def run_file(rule_output, run):
    """A run rule's output pattern filled in for one planned run (and its current evaluations)."""
    return rule_output.format(
        experiment=run.experiment,
        run_hash=paths.short(run.run_hash),
        eval_hash=paths.short(run.eval_hash),
        control_hash=paths.short(run.control_hash or ""),
    )


def _setting_options(settings):
    """The closed-loop settings as options of `worldpipe control evaluate` and `control references`."""
    options = [
        f"--{key.replace('_', '-')}={settings[key]}"
        for key in ("env_id", "behaviour_policy", "max_steps", "episodes", "seed", "context", "planner", "http_episodes")
        if key in settings
    ]
    options += [f"--set={override}" for override in settings.get("planner_overrides", [])]
    options += [f"--ceiling-set={override}" for override in settings.get("ceiling_overrides", [])]
    if settings.get("value") is not None:
        options.append(f"--value={json.dumps(settings['value'], sort_keys=True)}")
    return options


def control_options(wildcards):
    """`worldpipe control evaluate`'s options for a run's current closed-loop evaluation, quoted for the shell."""
    run = run_of(wildcards)
    if run.control_hash is None or paths.short(run.control_hash) != wildcards.control_hash:
        raise WorkflowError(f"control/{wildcards.control_hash} of {run.dir} is not its current closed-loop evaluation")
    return " ".join(shlex.quote(option) for option in _setting_options(control_settings(config, run.dataset)))


def references_file(rule_output, run):
    """The model-free contenders' file a run's closed-loop evaluation takes (its control settings and seed)."""
    return rule_output.format(control_hash=paths.short(run.control_hash), run_seed=run.seed)


def references_options(wildcards):
    """`worldpipe control references`' options for one closed-loop setting and run seed, quoted for the shell:
    the settings of any planned run with that control hash, the env as its training data's spec makes it."""
    run = next((r for r in RUNS_BY_HASH.values() if r.control_hash and paths.short(r.control_hash) == wildcards.control_hash),
               None)
    if run is None:
        raise WorkflowError(f"control/references/{wildcards.control_hash} is no current closed-loop evaluation's")
    spec = run.dataset.spec
    options = _setting_options(control_settings(config, run.dataset))
    options += [f"--action-repeat={int(spec.get('action_repeat', 1))}", f"--run-seed={wildcards.run_seed}"]
    if spec.get("observation_keys"):
        options.append(f"--observation-keys={','.join(spec['observation_keys'])}")
    return " ".join(shlex.quote(option) for option in options)


def yardstick_settings():
    """Per env the closed loop evaluates, the control settings its ceiling's budget curve is measured with and the
    training data's spec that makes the env (action repeat, observation key order)."""
    envs = {}
    for run in RUNS_BY_HASH.values():  # the experiments' runs first, then the rounds'
        settings = control_settings(config, run.dataset) if run.control_hash else None
        if settings:
            envs.setdefault(settings["env_id"], (settings, run.dataset.spec))
    return envs


def yardstick_options(wildcards):
    """`worldpipe control yardstick`'s options for one env: the closed loop's seeds, episodes and planner, and the
    env as the training data makes it."""
    found = yardstick_settings().get(wildcards.env_id)
    if found is None:
        raise WorkflowError(f"control yardstick {wildcards.env_id}: no run's closed loop evaluates that env "
                            f"(envs: {', '.join(sorted(yardstick_settings())) or 'none'})")
    settings, spec = found
    options = [f"--{key.replace('_', '-')}={settings[key]}" for key in ("max_steps", "episodes", "seed", "planner")]
    options += [f"--set={override}" for override in settings.get("planner_overrides", [])]
    if int(spec.get("action_repeat", 1)) != 1:  # only where not the default: a Gymnasium env's curve keeps its command
        options.append(f"--action-repeat={int(spec['action_repeat'])}")
    if spec.get("observation_keys"):
        options.append(f"--observation-keys={','.join(spec['observation_keys'])}")
    return " ".join(shlex.quote(option) for option in options)


def spec_json(wildcards):
    return json.dumps(dataset_of(wildcards).spec, sort_keys=True)


def shard_parts(dataset):
    """Shard ranges (start, stop, step) written by separate jobs; the bytes do not depend on this split.

    A collection round's parts take every parts-th shard: its first shards are copies of the earlier rounds
    (cheap), its last ones played by the planner, and interleaving gives each job a share of both.
    """
    spec = dataset.spec
    shards = math.ceil(spec["episodes"] / spec["episodes_per_shard"])
    parts = min(config["simulate_jobs"], shards)
    if spec.get("collector"):
        return [(p, shards, parts) for p in range(parts)]
    return [(p * shards // parts, (p + 1) * shards // parts, 1) for p in range(parts)]


def shard_range(wildcards):
    start, stop, step = shard_parts(dataset_of(wildcards))[int(wildcards.part)]
    return f"{start}:{stop}" if step == 1 else f"{start}:{stop}:{step}"


def collector_inputs(wildcards):
    """What a collection round's store needs before it is initialised: the collecting run's completion record
    and the dataset it trained on (its lineage is read from both). Nothing for a scripted policy's dataset."""
    collector = dataset_of(wildcards).spec.get("collector")
    if not collector:
        return []
    run = RUNS_BY_HASH[(collector["experiment"], paths.short(collector["run_hash"]))]
    return [run_file(rules.train_model.output.done, run), dataset_file(rules.seal_dataset.output.manifest, run.dataset)]


# Input functions (evaluated when the DAG is built, after every rule is defined).
def part_records(wildcards):
    count = len(shard_parts(dataset_of(wildcards)))
    return expand(rules.simulate_episodes.output.record, dataset=wildcards.dataset, spec_hash=wildcards.spec_hash,
                  part=range(count))


def training_data(wildcards):
    dataset = run_of(wildcards).dataset
    return {
        "manifest": dataset_file(rules.seal_dataset.output.manifest, dataset),
        "store": dataset_file(rules.init_store.output.store, dataset),
    }


def heldout_manifest(wildcards):
    """The held-out manifest of a run's current evaluation (an earlier evaluation is kept, not redone)."""
    run = run_of(wildcards)
    if paths.short(run.eval_hash) != wildcards.eval_hash:
        raise WorkflowError(
            f"eval/{wildcards.eval_hash} of {run.dir} is not the current evaluation ({paths.short(run.eval_hash)})"
        )
    return dataset_file(rules.seal_dataset.output.manifest, run.heldout)


def tracking_uri():
    """The pipeline's tracking_uri, else $MLFLOW_TRACKING_URI, else the default of worldpipe.config.paths."""
    uri = config.get("tracking_uri") or os.environ.get("MLFLOW_TRACKING_URI", "")
    return uri or paths.default_tracking_uri(Path(CONF_DIR))


def training_argv(wildcards):
    """The Hydra overrides that make a run (fixed by its hash), each quoted for the shell."""
    return " ".join(shlex.quote(item) for item in launch_overrides(run_of(wildcards)))


def rule_resources(rule_name):
    """Resources of a rule: the config's `resources.default`, overridden key by key by its own section."""
    return config["resources"]["default"] | config["resources"].get(rule_name, {})


def training_resources():
    """Resources of a training job (train_model, train_sweep_point).

    On SLURM: train.nnodes nodes, one task (one torchrun) each, the warning signal and GPUs per node
    (worldpipe.launch.slurm). `resume_safe_overrides` are the Hydra overrides every training job gets that a
    resume may change (world size, tracking URI, the pipeline's safe ones: worldpipe.pipeline.plan.
    training_settings), quoted for the shell. Like the node count they say how to run, not what is made: a
    change of a resource (unlike one of a parameter) does not make Snakemake remake the outputs, and a
    resume-safe setting is not part of a run's identity, so changing it must not retrain anything.
    """
    return slurm.training_job_resources(rule_resources("train_model"), config["train"]["nnodes"]) | {
        "resume_safe_overrides": shlex.join(training_settings(config, tracking_uri()))
    }


LOOPS_BY_ID = {rounds_id(found): found for found in LOOPS}


def loop_of(wildcards):
    """The loop (its rounds) a results/rounds/{rounds_id} target stands for."""
    found = LOOPS_BY_ID.get(wildcards.rounds_id)
    if found is None:
        raise WorkflowError(f"rounds/{wildcards.rounds_id} is not a loop of the current config "
                            f"({', '.join(LOOPS_BY_ID) or 'none'})")
    return found


def rounds_records(found):
    """Per round of one loop, the records its summary reads (in round order): its run's evaluations, its dataset's
    manifest, and the Snakemake benchmarks of the jobs that made it (collection, training, evaluation), read when
    present (a benchmark is a record of how long, not an input)."""
    records = []
    for r in found:
        data = f"{r.dataset.name}-{paths.short(r.dataset.spec_hash)}"
        run = f"{r.run.experiment}-{paths.short(r.run.run_hash)}"
        parts = range(len(shard_parts(r.dataset)))
        records.append({
            "round": r.index,
            "run_dir": r.run.dir,
            "metrics": run_file(rules.evaluate_model.output.metrics, r.run),
            "control": run_file(rules.evaluate_control.output.record, r.run),
            "manifest": dataset_file(rules.seal_dataset.output.manifest, r.dataset),
            "benchmarks": {
                "collection": [f"{RULE_BENCHMARKS}/init_store/{data}.tsv",
                               *(f"{RULE_BENCHMARKS}/simulate_episodes/{data}-{p}.tsv" for p in parts),
                               f"{RULE_BENCHMARKS}/seal_dataset/{data}.tsv"],
                "training": [f"{RULE_BENCHMARKS}/train_model/{run}.tsv"],
                "evaluation": [f"{RULE_BENCHMARKS}/evaluate_model/{run}-{paths.short(r.run.eval_hash)}.tsv",
                               f"{RULE_BENCHMARKS}/evaluate_control/{run}-{paths.short(r.run.control_hash)}.tsv"],
            },
        })
    return records
