# Training under torchrun, into <runs>/<experiment>/<run-hash>/ (the hash of the resolved config and dataset
# spec, see common.smk). Only the completion record is a declared output: the checkpoint directory beside it
# survives a failed or preempted job (exit 75), and the next invocation resumes from it. With
# --dataset-spec-hash, `worldpipe train` checks the directory is this config's, records the attempt in its
# run.json, points <experiment>/latest at it, and records how the attempt ended (for `worldpipe runs list`); it refuses
# a directory another process still trains in (naming it) and removes the previous attempt's completion record and
# evaluations, so an interrupted attempt never leaves "done" results behind. The
# parameters are what makes the run (fixed by its hash); the resume-safe settings are a resource (common.smk).


rule train_model:
    input:
        unpack(training_data),
    output:
        done=f"{RUNS}/{{experiment}}/{{run_hash}}/{paths.COMPLETION_RECORD}",
    params:
        spec_hash=lambda wildcards: run_of(wildcards).dataset.spec_hash,
        overrides=training_argv,
    threads: config["train"]["nproc_per_node"]
    # SLURM: one job of train.nnodes nodes, one task (one torchrun) per node. The `mpi` key makes the executor
    # plugin run this rule in the batch step, so `worldpipe train` starts training as a job step of its own, the
    # one the warning signal (--signal=USR1@N) reaches (worldpipe.launch.slurm). Requests are per node.
    resources:
        **training_resources(),
    conda:
        "../envs/worldpipe.yaml"
    log:
        f"{LOGS}/train_model/{{experiment}}-{{run_hash}}.log",
    benchmark:
        f"{RULE_BENCHMARKS}/train_model/{{experiment}}-{{run_hash}}.tsv"
    shell:
        "worldpipe train --dataset-spec-hash {params.spec_hash} --snakemake-rule train_model"
        " --snakemake-job {wildcards.experiment} {params.overrides} {resources.resume_safe_overrides} > {log} 2>&1"
        " || {{ code=$?; tail -n 1 {log} >&2; exit $code; }}"  # the one-line error shown, not only logged
