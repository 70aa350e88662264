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
            category="Evaluation",
            subcategory="{experiment}",
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
        " > {log} 2>&1"


rule plot_loss_curve:
    input:
        done=rules.train_model.output.done,
    output:
        plot=report(
            f"{RUNS}/{{experiment}}/{{run_hash}}/{paths.LOSS_CURVE}",
            caption="../report/loss_curve.rst",
            category="Training",
            subcategory="{experiment}",
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


rule plot_models_vs_baseline:
    input:
        metrics=[run_file(rules.evaluate_model.output.metrics, run) for run in RUNS_PLANNED.values()],
    output:
        plot=report(
            f"{RESULTS}/models_vs_baseline/{MODELS_VS_BASELINE_HASH}.png",
            caption="../report/models_vs_baseline.rst",
            category="Evaluation",
        ),
    params:
        experiments=list(RUNS_PLANNED),
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
