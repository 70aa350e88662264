# Sweeps (config `sweep`, see src/worldpipe/sweep.py): one training + one evaluation job per point, each in its own
# run directory results/sweeps/<name>/<point>/ and MLflow run, nested under the sweep's parent run; then a
# comparison table and plot of all points.
import json
import re

from worldpipe.sweep import expand_sweep, sweep_dir

SWEEP = config.get("sweep") or {}
SWEEP_POINTS = {point.name: point for point in expand_sweep(SWEEP)} if SWEEP else {}
SWEEP_DIR = sweep_dir(SWEEP)


wildcard_constraints:
    point="|".join(re.escape(name) for name in SWEEP_POINTS) or "no-sweep",


rule open_sweep:
    output:
        parent=f"{SWEEP_DIR}/parent.json",
    params:
        sweep=json.dumps(SWEEP),  # key order kept: the first swept key is the comparison plot's x axis
        tracking=tracking_uri(),
    conda:
        "../envs/worldpipe.yaml"
    resources:
        **rule_resources("open_sweep"),
    log:
        f"logs/open_sweep/{SWEEP.get('name', 'none')}.log",
    benchmark:
        f"benchmarks/rules/open_sweep/{SWEEP.get('name', 'none')}.tsv"
    shell:
        "worldpipe sweep open --sweep-json {params.sweep:q} --tracking-uri {params.tracking:q}"
        " --out {output.parent} > {log} 2>&1"


rule train_sweep_point:
    input:
        manifest=f"results/data/{TRAIN_DATASET}/manifest.json",
    output:
        done=f"{SWEEP_DIR}/{{point}}/train_done.json",
    params:
        store=f"results/data/{TRAIN_DATASET}/store.zarr",
        run_dir=lambda wildcards, output: os.path.dirname(output.done),
        experiment=SWEEP.get("experiment"),
        run_name=lambda wildcards: SWEEP_POINTS[wildcards.point].run_name(SWEEP["name"]),
        point=lambda wildcards: " ".join(SWEEP_POINTS[wildcards.point].overrides),
        nproc=config["train"]["nproc_per_node"],
        nnodes=config["train"].get("nnodes", 1),
        tracking=tracking_uri(),
        mlflow_experiment=SWEEP.get("mlflow_experiment", "worldpipe"),
        overrides=" ".join(config["train"].get("overrides", [])),
        launcher=LAUNCH_TRAINING,
    threads: config["train"]["nproc_per_node"]
    resources:
        **training_resources(),
    conda:
        "../envs/worldpipe.yaml"
    log:
        f"logs/train_sweep_point/{SWEEP.get('name', 'none')}/{{point}}.log",
    benchmark:
        f"benchmarks/rules/train_sweep_point/{SWEEP.get('name', 'none')}/{{point}}.tsv"
    shell:
        "WORLDPIPE_RULE=train_sweep_point WORLDPIPE_JOB={wildcards.point:q}"
        " bash {params.launcher}"
        " experiment={params.experiment} experiment_name={params.run_name:q} run_dir={params.run_dir:q}"
        " data.store={params.store} data.manifest={input.manifest} parallel.nproc_per_node={params.nproc}"
        " parallel.nnodes={params.nnodes} tracking.uri={params.tracking:q}"
        " tracking.experiment={params.mlflow_experiment:q} {params.overrides} {params.point} >> {log} 2>&1"


rule evaluate_sweep_point:
    input:
        done=f"{SWEEP_DIR}/{{point}}/train_done.json",
        parent=f"{SWEEP_DIR}/parent.json",
        manifest=f"results/data/{HELDOUT_DATASET}/manifest.json",
    output:
        metrics=f"{SWEEP_DIR}/{{point}}/eval/metrics.json",
        plot=f"{SWEEP_DIR}/{{point}}/eval/error_vs_horizon.png",
    params:
        store=f"results/data/{HELDOUT_DATASET}/store.zarr",
        checkpoints=lambda wildcards, input: os.path.join(os.path.dirname(input.done), "checkpoints"),
        values=lambda wildcards: json.dumps(SWEEP_POINTS[wildcards.point].as_dict(), sort_keys=True),
        context=config["evaluate"]["context"],
        horizon=config["evaluate"]["horizon"],
        tracking=tracking_uri(),
    conda:
        "../envs/worldpipe.yaml"
    resources:
        **rule_resources("evaluate_model"),
    log:
        f"logs/evaluate_sweep_point/{SWEEP.get('name', 'none')}/{{point}}.log",
    benchmark:
        f"benchmarks/rules/evaluate_sweep_point/{SWEEP.get('name', 'none')}/{{point}}.tsv"
    shell:
        "(worldpipe sweep link --parent {input.parent} --done {input.done:q} --point {wildcards.point:q}"
        " --values-json {params.values:q} --tracking-uri {params.tracking:q}"
        " && worldpipe evaluate --checkpoints {params.checkpoints:q} --store {params.store}"
        " --manifest {input.manifest} --context {params.context} --horizon {params.horizon}"
        " --out {output.metrics:q} --plot {output.plot:q} --tracking-uri {params.tracking:q}) > {log} 2>&1"


rule compare_sweep:
    input:
        parent=f"{SWEEP_DIR}/parent.json",
        metrics=expand(f"{SWEEP_DIR}/{{point}}/eval/metrics.json", point=list(SWEEP_POINTS)),
    output:
        table=f"{SWEEP_DIR}/compare.txt",
        plot=report(f"{SWEEP_DIR}/compare.png", caption="../report/sweep_compare.rst", category="Sweep"),
    params:
        tracking=tracking_uri(),
    conda:
        "../envs/worldpipe.yaml"
    resources:
        **rule_resources("compare_sweep"),
    log:
        f"logs/compare_sweep/{SWEEP.get('name', 'none')}.log",
    benchmark:
        f"benchmarks/rules/compare_sweep/{SWEEP.get('name', 'none')}.tsv"
    shell:
        "worldpipe compare {input.parent} --tracking-uri {params.tracking:q} --plot {output.plot}"
        " --out {output.table} > {log} 2>&1"
