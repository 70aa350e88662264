# Helpers shared by the rules: dataset specs, shard partitions, paths. No rules here.
import json
import math
import os

from worldpipe.preflight import validate_pipeline_experiments


def dataset_spec(dataset):
    """Generation spec of a dataset wildcard: the configured dataset or its held-out sibling."""
    spec = dict(config["dataset"])
    if dataset == spec["name"]:
        return spec
    if dataset == f"{spec['name']}-heldout":
        spec.update(name=dataset, episodes=config["heldout"]["episodes"], seed=config["heldout"]["seed"])
        return spec
    raise ValueError(f"unknown dataset {dataset!r}: expected {spec['name']!r} or its -heldout")


def spec_json(wildcards):
    return json.dumps(dataset_spec(wildcards.dataset), sort_keys=True)


def shard_parts(dataset):
    """Shard ranges [start, stop) simulated by separate jobs; the bytes do not depend on this split."""
    spec = dataset_spec(dataset)
    shards = math.ceil(spec["episodes"] / spec["episodes_per_shard"])
    parts = min(config["simulate_jobs"], shards)
    return [(p * shards // parts, (p + 1) * shards // parts) for p in range(parts)]


def part_records(wildcards):
    count = len(shard_parts(wildcards.dataset))
    return [f"results/data/{wildcards.dataset}/parts/part-{p:03d}.json" for p in range(count)]


def shard_range(wildcards):
    start, stop = shard_parts(wildcards.dataset)[int(wildcards.part)]
    return f"{start}:{stop}"


def tracking_uri():
    uri = config.get("tracking_uri") or os.environ.get("MLFLOW_TRACKING_URI", "")
    return uri or f"sqlite:///{os.path.abspath('results/mlflow.db')}"


def rule_resources(rule_name):
    """Resources of a rule: the config's `resources.default`, overridden key by key by its own section."""
    return config["resources"]["default"] | config["resources"].get(rule_name, {})


# Keys of the train_model section that become sbatch options through slurm_extra, not Snakemake resources.
TRAINING_SBATCH_KEYS = ("gpu", "gpus_per_node", "preempt_signal_s", "slurm_extra")


def training_resources():
    """train_model's resources: one task per node on `train.nnodes` nodes, warning signal, GPUs per node.

    `mpi` is present (empty) so the SLURM plugin runs the rule in the batch step and the training job step
    started by launch_training.sh is the only one the warning signal reaches.
    """
    merged = rule_resources("train_model")
    extra = ["--ntasks-per-node=1"]
    if merged.get("preempt_signal_s", 0) > 0:
        extra.append(f"--signal=USR1@{merged['preempt_signal_s']}")
    if merged.get("gpus_per_node", 0) > 0:
        extra.append(f"--gpus-per-node={merged['gpus_per_node']}")
    if merged.get("slurm_extra"):
        extra.append(merged["slurm_extra"])
    nodes = config["train"]["nnodes"]
    plain = {key: value for key, value in merged.items() if key not in TRAINING_SBATCH_KEYS}
    return plain | {"nodes": nodes, "tasks": nodes, "mpi": "", "slurm_extra": " ".join(extra)}


# Every experiment's training config (with train.overrides) is composed and validated now, while the Snakefile
# is parsed: a bad value stops the pipeline before the data stages run.
validate_pipeline_experiments(config)

LAUNCH_TRAINING = os.path.join(workflow.basedir, "workflow", "scripts", "launch_training.sh")
TRAIN_DATASET = config["dataset"]["name"]
HELDOUT_DATASET = f"{TRAIN_DATASET}-heldout"
