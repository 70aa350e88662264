# Imagination rollouts on held-out episodes, and the figures of the report.


rule evaluate_model:
    input:
        done="results/runs/{experiment}/train_done.json",
        manifest=f"results/data/{HELDOUT_DATASET}/manifest.json",
    output:
        metrics="results/runs/{experiment}/eval/metrics.json",
        plot=report(
            "results/runs/{experiment}/eval/error_vs_horizon.png",
            caption="../report/error_vs_horizon.rst",
            category="Evaluation",
        ),
    params:
        store=f"results/data/{HELDOUT_DATASET}/store.zarr",
        checkpoints="results/runs/{experiment}/checkpoints",
        context=config["evaluate"]["context"],
        horizon=config["evaluate"]["horizon"],
    conda:
        "../envs/worldpipe.yaml"
    resources:
        **rule_resources("evaluate_model"),
    log:
        "logs/evaluate_model/{experiment}.log",
    benchmark:
        "benchmarks/rules/evaluate_model/{experiment}.tsv"
    shell:
        "worldpipe evaluate --checkpoints {params.checkpoints} --store {params.store} --manifest {input.manifest}"
        " --context {params.context} --horizon {params.horizon} --out {output.metrics} --plot {output.plot}"
        " > {log} 2>&1"


rule plot_loss_curve:
    input:
        done="results/runs/{experiment}/train_done.json",
    output:
        plot=report(
            "results/runs/{experiment}/eval/loss_curve.png",
            caption="../report/loss_curve.rst",
            category="Training",
        ),
    params:
        tracking=tracking_uri(),
    conda:
        "../envs/worldpipe.yaml"
    resources:
        **rule_resources("plot_loss_curve"),
    log:
        "logs/plot_loss_curve/{experiment}.log",
    benchmark:
        "benchmarks/rules/plot_loss_curve/{experiment}.tsv"
    script:
        "../scripts/plot_loss_curve.py"
