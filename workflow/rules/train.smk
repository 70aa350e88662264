# Training under torchrun, into <runs>/<experiment>/<run-hash>/ (the hash of the resolved config and dataset
# spec, see common.smk). Only the completion record is a declared output: the checkpoint directory beside it
# survives a failed or preempted job, and the next invocation resumes from it. `worldpipe runs begin` refuses a
# directory another process still trains in (naming it) or that is not this config's, removes the previous
# attempt's completion record and evaluations (so an interrupted attempt never leaves "done" results behind),
# records the attempt and points <experiment>/latest at it; `runs end` records how the attempt ended (for
# `worldpipe runs list`). The parameters are what makes the run (fixed by its hash); the
# resume-safe settings, the conf/ tree and the launcher come from the environment (common.smk).


rule train_model:
    input:
        unpack(training_data),
    output:
        done=f"{RUNS}/{{experiment}}/{{run_hash}}/{paths.COMPLETION_RECORD}",
    params:
        run_dir=lambda wildcards, output: os.path.dirname(output.done),
        spec_hash=lambda wildcards: run_of(wildcards).dataset.spec_hash,
        overrides=training_argv,
    threads: config["train"]["nproc_per_node"]
    # SLURM: one job of train.nnodes nodes, one task (one torchrun) per node. The `mpi` key makes the executor
    # plugin run this rule in the batch step, so launch_training.sh starts training as a job step of its own,
    # the one the warning signal (--signal=USR1@N) reaches; its empty value keeps the plugin's MPI check
    # (tasks > 1) away from single-node jobs. Requests are per node.
    resources:
        **training_resources(),
    conda:
        "../envs/worldpipe.yaml"
    log:
        f"{LOGS}/train_model/{{experiment}}-{{run_hash}}.log",
    benchmark:
        f"{RULE_BENCHMARKS}/train_model/{{experiment}}-{{run_hash}}.tsv"
    shell:
        """
        eval "settings=($WORLDPIPE_TRAINING_SETTINGS)"  # shell-quoted by shlex.join in common.smk
        # A refusal (another process holds the run, the directory is another config's) is shown, not only logged.
        worldpipe runs begin {params.run_dir} --dataset-spec-hash {params.spec_hash} {params.overrides} \
            "${{settings[@]}}" > {log} 2>&1 || {{ code=$?; tail -n 1 {log} >&2; exit $code; }}
        code=0
        WORLDPIPE_RULE=train_model WORLDPIPE_JOB={wildcards.experiment} \
            bash "$WORLDPIPE_LAUNCH_TRAINING" {params.overrides} "${{settings[@]}}" >> {log} 2>&1 || code=$?
        worldpipe runs end {params.run_dir} --exit-code $code >> {log} 2>&1
        exit $code
        """
