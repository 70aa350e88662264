# Training under torchrun. Only the completion record is a declared output: the checkpoint directory beside
# it survives a failed or preempted job, and the next invocation resumes from it. Config text reaches the
# command only quoted (`:q` quotes each override of the list): no shell interpolation.


rule train_model:
    input:
        manifest=f"results/data/{TRAIN_DATASET}/manifest.json",
    output:
        done="results/runs/{experiment}/train_done.json",
    params:
        store=f"results/data/{TRAIN_DATASET}/store.zarr",
        run_dir=lambda wildcards, output: os.path.dirname(output.done),
        nproc=config["train"]["nproc_per_node"],
        nnodes=config["train"].get("nnodes", 1),
        tracking=tracking_uri(),
        overrides=config["train"].get("overrides", []),
        launcher=LAUNCH_TRAINING,
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
        "logs/train_model/{experiment}.log",
    benchmark:
        "benchmarks/rules/train_model/{experiment}.tsv"
    shell:
        "WORLDPIPE_RULE=train_model WORLDPIPE_JOB={wildcards.experiment}"
        " bash {params.launcher}"
        " experiment={wildcards.experiment} run_dir={params.run_dir} data.store={params.store}"
        " data.manifest={input.manifest} parallel.nproc_per_node={params.nproc} parallel.nnodes={params.nnodes}"
        " tracking.uri={params.tracking:q} {params.overrides:q} >> {log} 2>&1"
