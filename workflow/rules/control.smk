# Closed-loop evaluation: a planner acts in the real environment with each run's model, on held-out seeds, beside
# random, the behaviour policy and the same planner with the true simulator. One control/<control-hash>/ per
# setting, so a changed setting adds one beside the earlier. After evaluate_model: the logged model it annotates.


# The contenders that do not use the run's model (random actions, the behaviour policy, the planner with the true
# simulator) once per closed-loop setting and run seed: every run with both takes them (a loop's rounds, experiments
# on the same data), so the ceiling's true-simulator episodes run once, not once per run.
rule evaluate_references:
    output:
        record=f"{RESULTS}/control/references/{{control_hash}}/seed-{{run_seed}}.json",
    params:
        options=references_options,
    conda:
        "../envs/worldpipe.yaml"
    resources:
        **rule_resources("evaluate_references"),
    log:
        f"{LOGS}/evaluate_references/{{control_hash}}-seed-{{run_seed}}.log",
    benchmark:
        f"{RULE_BENCHMARKS}/evaluate_references/{{control_hash}}-seed-{{run_seed}}.tsv"
    shell:
        "worldpipe control references {params.options} --out {output.record} > {log} 2>&1"


rule evaluate_control:
    input:
        done=rules.train_model.output.done,
        evaluated=lambda wildcards: run_file(rules.evaluate_model.output.metrics, run_of(wildcards)),
        references=lambda wildcards: references_file(rules.evaluate_references.output.record, run_of(wildcards)),
    output:
        record=f"{RUNS}/{{experiment}}/{{run_hash}}/{paths.CONTROL_DIR}/{{control_hash}}/control.json",
        returns=report(
            f"{RUNS}/{{experiment}}/{{run_hash}}/{paths.CONTROL_DIR}/{{control_hash}}/returns.png",
            caption="../report/control_returns.rst",
            category="{experiment}",
            labels=lambda wildcards: run_labels(wildcards, "closed-loop returns"),
        ),
        loop=report(
            f"{RUNS}/{{experiment}}/{{run_hash}}/{paths.CONTROL_DIR}/{{control_hash}}/control_loop.png",
            caption="../report/control_loop.rst",
            category="{experiment}",
            labels=lambda wildcards: run_labels(wildcards, "control loop"),
        ),
        pictures=report(
            directory(f"{RUNS}/{{experiment}}/{{run_hash}}/{paths.CONTROL_DIR}/{{control_hash}}/pictures"),
            patterns=["{name}.gif"],
            caption="../report/control_pictures.rst",
            category="Pictures",
            subcategory="{experiment}",
            labels={"experiment": "{experiment}", "picture": "{name}"},
        ),
    params:
        checkpoints=lambda wildcards, input: paths.checkpoints_dir(os.path.dirname(input.done)),
        options=control_options,
    conda:
        "../envs/worldpipe.yaml"
    resources:
        **rule_resources("evaluate_control"),
    log:
        f"{LOGS}/evaluate_control/{{experiment}}-{{run_hash}}-{{control_hash}}.log",
    benchmark:
        f"{RULE_BENCHMARKS}/evaluate_control/{{experiment}}-{{run_hash}}-{{control_hash}}.tsv"
    shell:
        "worldpipe control evaluate --checkpoints {params.checkpoints} {params.options} --references {input.references}"
        " --out {output.record} --plot {output.returns} --loop-plot {output.loop} --pictures {output.pictures}"
        " > {log} 2>&1"


# Every experiment's closed loop on one figure, in the report's all-experiments category beside the open-loop one.
CONTROLLED_RUNS = {name: run for name, run in RUNS_PLANNED.items() if run.control_hash}
CONTROL_OVERVIEW_HASH = comparison_id(CONTROLLED_RUNS, control=True)


rule plot_control_overview:
    input:
        records=[run_file(rules.evaluate_control.output.record, run) for run in CONTROLLED_RUNS.values()],
    output:
        plot=report(
            f"{RESULTS}/control_overview/{CONTROL_OVERVIEW_HASH}.png",
            caption="../report/control_overview.rst",
            category=ALL_EXPERIMENTS,
            labels={"figure": "closed loop vs yardsticks", "experiments": ", ".join(CONTROLLED_RUNS)},
        ),
    params:
        labels=[f"{run.experiment} ({paths.short(run.run_hash)})" for run in CONTROLLED_RUNS.values()],
    conda:
        "../envs/worldpipe.yaml"
    resources:
        **rule_resources("plot_control_overview"),
    log:
        f"{LOGS}/plot_control_overview/{CONTROL_OVERVIEW_HASH}.log",
    benchmark:
        f"{RULE_BENCHMARKS}/plot_control_overview/{CONTROL_OVERVIEW_HASH}.tsv"
    script:
        "../scripts/plot_control_overview.py"


# The ceiling's return against its budget (`worldpipe control yardstick`): the curve behind `control:
# ceiling_overrides`, per env the closed loop evaluates; the planner with the true simulator, no model. Not part of
# `all` (minutes of episodes): `snakemake --cores 2 control_yardstick`.
YARDSTICK = f"{RESULTS}/control/yardstick"


rule measure_yardstick:
    output:
        curve=f"{YARDSTICK}/{{env_id}}.json",
        plot=report(
            f"{YARDSTICK}/{{env_id}}.png",
            caption="../report/control_yardstick.rst",
            category="Control yardstick",
            labels={"env": "{env_id}", "figure": "ceiling vs budget"},
        ),
    params:
        options=yardstick_options,
    conda:
        "../envs/worldpipe.yaml"
    resources:
        **rule_resources("measure_yardstick"),
    log:
        f"{LOGS}/measure_yardstick/{{env_id}}.log",
    benchmark:
        f"{RULE_BENCHMARKS}/measure_yardstick/{{env_id}}.tsv"
    shell:
        "worldpipe control yardstick --env-id {wildcards.env_id} {params.options}"
        " --out {output.curve} --plot {output.plot} > {log} 2>&1"


rule control_yardstick:
    input:
        [f"{YARDSTICK}/{env_id}.json" for env_id in sorted(yardstick_settings())],
