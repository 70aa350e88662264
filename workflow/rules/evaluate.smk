# Imagination rollouts on the held-out sibling of each run's dataset, and the figures of the report. Evaluations
# land in eval/<eval-hash>/ (held-out spec, context, horizon), so changing them adds one beside the earlier.


rule evaluate_model:
    input:
        done=rules.train_model.output.done,
        manifest=heldout_manifest,
    output:
        metrics=f"{RUNS}/{{experiment}}/{{run_hash}}/{paths.EVAL_DIR}/{{eval_hash}}/metrics.json",
        plot=report(
            f"{RUNS}/{{experiment}}/{{run_hash}}/{paths.EVAL_DIR}/{{eval_hash}}/error_vs_horizon.png",
            caption="../report/error_vs_horizon.rst",
            category="{experiment}",
            labels=lambda wildcards: run_labels(wildcards, "error vs horizon") | {"evaluation": wildcards.eval_hash},
        ),
        pictures=report(
            directory(f"{RUNS}/{{experiment}}/{{run_hash}}/{paths.EVAL_DIR}/{{eval_hash}}/pictures"),
            patterns=["{model}-{kind}-{episode}.{ext}"],
            caption="../report/pictures.rst",
            category="Pictures",
            subcategory="{experiment}",
            labels={"experiment": "{experiment}", "model": "{model}", "picture": "{kind}", "episode": "{episode}"},
        ),
    params:
        store=lambda wildcards: dataset_file(rules.init_store.output.store, run_of(wildcards).heldout),
        checkpoints=lambda wildcards, input: paths.checkpoints_dir(os.path.dirname(input.done)),
        context=config["evaluate"]["context"],
        horizon=config["evaluate"]["horizon"],
    conda:
        "../envs/worldpipe.yaml"
    resources:
        **rule_resources("evaluate_model"),
    log:
        f"{LOGS}/evaluate_model/{{experiment}}-{{run_hash}}-{{eval_hash}}.log",
    benchmark:
        f"{RULE_BENCHMARKS}/evaluate_model/{{experiment}}-{{run_hash}}-{{eval_hash}}.tsv"
    shell:
        "worldpipe evaluate --checkpoints {params.checkpoints} --store {params.store} --manifest {input.manifest}"
        " --context {params.context} --horizon {params.horizon} --out {output.metrics} --plot {output.plot}"
        " --pictures {output.pictures}"
        " > {log} 2>&1"


rule plot_loss_curve:
    input:
        done=rules.train_model.output.done,
    output:
        plot=report(
            f"{RUNS}/{{experiment}}/{{run_hash}}/{paths.LOSS_CURVE}",
            caption="../report/loss_curve.rst",
            category="{experiment}",
            labels=lambda wildcards: run_labels(wildcards, "training loss"),
        ),
    params:
        tracking=tracking_uri(),
    conda:
        "../envs/worldpipe.yaml"
    resources:
        **rule_resources("plot_loss_curve"),
    log:
        f"{LOGS}/plot_loss_curve/{{experiment}}-{{run_hash}}.log",
    benchmark:
        f"{RULE_BENCHMARKS}/plot_loss_curve/{{experiment}}-{{run_hash}}.tsv"
    script:
        "../scripts/plot_loss_curve.py"


# Named by the set of runs and evaluations it compares: an edit and its undo return to the same file.
MODELS_VS_BASELINE_HASH = comparison_id(RUNS_PLANNED)


# The report's category of the comparison across experiments (each experiment has a category of its own).
ALL_EXPERIMENTS = "All experiments"


rule plot_models_vs_baseline:
    input:
        metrics=[run_file(rules.evaluate_model.output.metrics, run) for run in RUNS_PLANNED.values()],
    output:
        plot=report(
            f"{RESULTS}/models_vs_baseline/{MODELS_VS_BASELINE_HASH}.png",
            caption="../report/models_vs_baseline.rst",
            category=ALL_EXPERIMENTS,
            labels={"figure": "models vs baseline", "experiments": ", ".join(RUNS_PLANNED)},
        ),
    params:
        labels=[f"{run.experiment} ({paths.short(run.run_hash)})" for run in RUNS_PLANNED.values()],
    conda:
        "../envs/worldpipe.yaml"
    resources:
        **rule_resources("plot_models_vs_baseline"),
    log:
        f"{LOGS}/plot_models_vs_baseline/{MODELS_VS_BASELINE_HASH}.log",
    benchmark:
        f"{RULE_BENCHMARKS}/plot_models_vs_baseline/{MODELS_VS_BASELINE_HASH}.tsv"
    script:
        "../scripts/plot_models_vs_baseline.py"
