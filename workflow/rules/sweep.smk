# Sweeps (config `sweep`, see src/worldpipe/pipeline/sweep.py): one training + one evaluation job per point, each in its own
# run directory <results>/sweeps/<name>/<point>/ and MLflow run, nested under the sweep's parent run; then a
# comparison table and plot of all points. Every point trains on the dataset of the sweep's base experiment.
import json
import re
import shlex

from worldpipe.pipeline.plan import identity_overrides, plan_run
from worldpipe.pipeline.sweep import SweepError, check_sweep, sweep_dir

SWEEP = config.get("sweep") or {}
# Checked while the Snakefile is parsed, before any job is planned: a safe name, an existing experiment, swept
# keys that exist in its config, and every point's config passing the checks of a single run.
try:
    SWEEP_POINTS = {point.name: point for point in check_sweep(config, Path(CONF_DIR))} if SWEEP else {}
    # The plan's run when the sweep's experiment is also one of `experiments` (composed once, not twice).
    SWEEP_BASE = (RUNS_PLANNED.get(SWEEP["experiment"]) or plan_run(config, SWEEP["experiment"], DATASETS,
                  Path(CONF_DIR))) if SWEEP else None
except (PipelineError, SweepError) as err:
    files = ", ".join(map(str, workflow.overwrite_configfiles or workflow.configfiles))  # the ones given first
    refuse(f"pipeline config {files}: {err}")
SWEEP_DIR = sweep_dir(SWEEP, Path(CONF_DIR))
SWEEP_NAME = SWEEP.get("name", "none")
SWEEP_DATA = (
    {
        "manifest": dataset_file(rules.seal_dataset.output.manifest, SWEEP_BASE.dataset),
        "store": dataset_file(rules.init_store.output.store, SWEEP_BASE.dataset),
        "heldout_manifest": dataset_file(rules.seal_dataset.output.manifest, SWEEP_BASE.heldout),
        "heldout_store": dataset_file(rules.init_store.output.store, SWEEP_BASE.heldout),
    }
    if SWEEP
    else {}
)


# The report shows a sweep in one category: the comparison, then each point's plot labelled by its values. Only
# the points carry the other labels, so Snakemake never folds two rows into a toggle (an extra click).
SWEEP_CATEGORY = f"Sweep {SWEEP_NAME}"


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
        f"{LOGS}/open_sweep/{SWEEP_NAME}.log",
    benchmark:
        f"{RULE_BENCHMARKS}/open_sweep/{SWEEP_NAME}.tsv"
    shell:
        "worldpipe sweep open --sweep-json {params.sweep:q} --tracking-uri {params.tracking:q}"
        " --out {output.parent} > {log} 2>&1"


rule train_sweep_point:
    input:
        manifest=SWEEP_DATA.get("manifest", []),
        store=SWEEP_DATA.get("store", []),
    output:
        done=f"{SWEEP_DIR}/{{point}}/{paths.COMPLETION_RECORD}",
    params:
        run_dir=lambda wildcards, output: os.path.dirname(output.done),
        run_name=lambda wildcards: SWEEP_POINTS[wildcards.point].run_name(SWEEP_NAME),
        # the MLflow run's name: the point's values in short form (lr=3e-4,stoch=8)
        label=lambda wildcards: SWEEP_POINTS[wildcards.point].label_override,
        # the base experiment and the pipeline's identity overrides, then the point's values
        overrides=lambda wildcards: shlex.join(
            [*identity_overrides(config, SWEEP["experiment"]), *SWEEP_POINTS[wildcards.point].overrides]
        ),
        mlflow_experiment=SWEEP.get("mlflow_experiment", "worldpipe"),
    threads: config["train"]["nproc_per_node"]
    resources:
        **training_resources(),
    conda:
        "../envs/worldpipe.yaml"
    log:
        f"{LOGS}/train_sweep_point/{SWEEP_NAME}/{{point}}.log",
    benchmark:
        f"{RULE_BENCHMARKS}/train_sweep_point/{SWEEP_NAME}/{{point}}.tsv"
    shell:
        "worldpipe train --snakemake-rule train_sweep_point --snakemake-job {wildcards.point:q} {params.overrides}"
        " experiment_name={params.run_name:q} {params.label:q} run_dir={params.run_dir:q} data.store={input.store}"
        " data.manifest={input.manifest} tracking.experiment={params.mlflow_experiment:q} {resources.resume_safe_overrides}"
        " > {log} 2>&1"


rule evaluate_sweep_point:
    input:
        done=f"{SWEEP_DIR}/{{point}}/{paths.COMPLETION_RECORD}",
        parent=f"{SWEEP_DIR}/parent.json",
        manifest=SWEEP_DATA.get("heldout_manifest", []),
    output:
        metrics=f"{SWEEP_DIR}/{{point}}/{paths.EVAL_DIR}/metrics.json",
        plot=report(
            f"{SWEEP_DIR}/{{point}}/{paths.EVAL_DIR}/error_vs_horizon.png",
            caption="../report/error_vs_horizon.rst",
            category=SWEEP_CATEGORY,
            labels=lambda wildcards: point_labels(wildcards.point),
        ),
    params:
        store=SWEEP_DATA.get("heldout_store"),
        checkpoints=lambda wildcards, input: paths.checkpoints_dir(os.path.dirname(input.done)),
        values=lambda wildcards: json.dumps(SWEEP_POINTS[wildcards.point].as_dict(), sort_keys=True),
        context=config["evaluate"]["context"],
        horizon=config["evaluate"]["horizon"],
        tracking=tracking_uri(),
    conda:
        "../envs/worldpipe.yaml"
    resources:
        **rule_resources("evaluate_model"),
    log:
        f"{LOGS}/evaluate_sweep_point/{SWEEP_NAME}/{{point}}.log",
    benchmark:
        f"{RULE_BENCHMARKS}/evaluate_sweep_point/{SWEEP_NAME}/{{point}}.tsv"
    shell:
        "(worldpipe sweep link --parent {input.parent} --done {input.done:q} --point {wildcards.point:q}"
        " --values-json {params.values:q} --tracking-uri {params.tracking:q}"
        " && worldpipe evaluate --checkpoints {params.checkpoints:q} --store {params.store}"
        " --manifest {input.manifest} --context {params.context} --horizon {params.horizon}"
        " --out {output.metrics:q} --plot {output.plot:q} --tracking-uri {params.tracking:q}) > {log} 2>&1"


rule compare_sweep:
    input:
        parent=f"{SWEEP_DIR}/parent.json",
        metrics=expand(f"{SWEEP_DIR}/{{point}}/{paths.EVAL_DIR}/metrics.json", point=list(SWEEP_POINTS)),
    output:
        table=f"{SWEEP_DIR}/compare.txt",
        plot=report(
            f"{SWEEP_DIR}/compare.png",
            caption="../report/sweep_compare.rst",
            category=SWEEP_CATEGORY,
            labels={"point": "all points (comparison)"},
        ),
    params:
        tracking=tracking_uri(),
    conda:
        "../envs/worldpipe.yaml"
    resources:
        **rule_resources("compare_sweep"),
    log:
        f"{LOGS}/compare_sweep/{SWEEP_NAME}.log",
    benchmark:
        f"{RULE_BENCHMARKS}/compare_sweep/{SWEEP_NAME}.tsv"
    shell:
        "(worldpipe sweep summarize --parent {input.parent} --tracking-uri {params.tracking:q}"
        " && worldpipe compare {input.parent} --tracking-uri {params.tracking:q} --plot {output.plot}"
        " --out {output.table}) > {log} 2>&1"
