# worldpipe: simulate -> shard (zarr + manifest) -> train (torchrun, Hydra) -> evaluate -> report.
# This file only wires; rules live in workflow/rules/, their code in src/worldpipe/ and workflow/scripts/.
import os
from pathlib import Path

from snakemake.utils import min_version, validate

from worldpipe.pipeline.config_check import refuse, schema_problem

min_version("9.0")


# Relative to this file, so `snakemake -s .../Snakefile --directory elsewhere` finds its defaults.
configfile: os.path.join(workflow.basedir, "conf", "pipeline", "default.yaml")


# `control: null` in a config file turns the closed loop off (config files merge key by key: leaving the section
# out keeps the defaults').
if "control" in config and config["control"] is None:
    del config["control"]
# One line naming the key, else Snakemake's validate (which also fills in the schema's defaults).
CONFIG_SCHEMA = "workflow/schemas/config.schema.yaml"
if problem := schema_problem(config, os.path.join(workflow.basedir, CONFIG_SCHEMA)):
    refuse(f"pipeline config: {problem}")
validate(config, CONFIG_SCHEMA)


report: "workflow/report/workflow.rst"


include: "workflow/rules/common.smk"
include: "workflow/rules/data.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/evaluate.smk"
include: "workflow/rules/control.smk"
include: "workflow/rules/rounds.smk"
include: "workflow/rules/bench.smk"
include: "workflow/rules/sweep.smk"


# What a later `snakemake --report` with no --configfile renders (worldpipe.pipeline.report_config).
onsuccess:
    if report_config.built_the_pipeline(workflow.dag_settings.targets):
        report_config.record(config, PATHS["pipeline_config"])


# The current config's run of every experiment (earlier runs stay on disk, outside the DAG).
rule all:
    default_target: True
    input:
        [
            run_file(output, run)
            for run in RUNS_PLANNED.values()
            for output in (
                rules.evaluate_model.output.metrics,
                rules.evaluate_model.output.plot,
                rules.plot_loss_curve.output.plot,
            )
        ],
        [
            run_file(output, run)
            for run in RUNS_PLANNED.values()
            if run.control_hash
            for output in (rules.evaluate_control.output.returns, rules.evaluate_control.output.loop)
        ],
        [rules.plot_models_vs_baseline.output.plot] if RUNS_PLANNED else [],  # a sweep-only config has none
        [rules.plot_control_overview.output.plot] if CONTROLLED_RUNS else [],
        [f"{directory}/return_vs_round.png" for directory in ROUNDS_DIRS],
        [rules.summarize_time_to_quality.output.plot] if len(LOOPS) > 1 else [],  # across loop seeds
        sweep_targets(config.get("sweep"), Path(CONF_DIR)),
