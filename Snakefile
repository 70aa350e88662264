# worldpipe: simulate -> shard (zarr + manifest) -> train (torchrun, Hydra) -> evaluate -> report.
# This file only wires; rules live in workflow/rules/, their code in src/worldpipe/ and workflow/scripts/.
import os

from snakemake.utils import min_version, validate

from worldpipe.sweep import sweep_targets

min_version("9.0")


# Relative to this file, so `snakemake -s .../Snakefile --directory elsewhere` finds its defaults.
configfile: os.path.join(workflow.basedir, "conf", "pipeline", "default.yaml")


validate(config, "workflow/schemas/config.schema.yaml")


report: "workflow/report/workflow.rst"


include: "workflow/rules/common.smk"
include: "workflow/rules/data.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/evaluate.smk"
include: "workflow/rules/sweep.smk"


rule all:
    input:
        expand(
            "results/runs/{experiment}/eval/{product}",
            experiment=config["experiments"],
            product=["metrics.json", "error_vs_horizon.png", "loss_curve.png"],
        ),
        sweep_targets(config.get("sweep")),
