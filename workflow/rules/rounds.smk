# Data-collection rounds (config `rounds`, see src/worldpipe/pipeline/rounds.py). Round k >= 1's dataset is built by
# the data rules (init_store waits for round k-1's training, simulate_episodes collects with its model), and its run
# by train_model, evaluate_model and evaluate_control like any run; this file adds only the loops' summaries: per
# loop, the return against round (and against real env steps), the rounds nested under one MLflow parent run; across
# loop seeds (`rounds: loop_seeds`), time-to-quality.
ROUNDS_DIRS = [paths.rounds_dir(loop_id, Path(CONF_DIR)) for loop_id in LOOPS_BY_ID]
LOOPS_ID = loops_id(LOOPS) if LOOPS else "none"
LOOPS_DIR = paths.rounds_dir(LOOPS_ID, Path(CONF_DIR))


wildcard_constraints:
    rounds_id=HASH_PATTERN,


rule summarize_rounds:
    input:
        metrics=lambda wildcards: [record["metrics"] for record in rounds_records(loop_of(wildcards))],
        control=lambda wildcards: [record["control"] for record in rounds_records(loop_of(wildcards))],
        manifests=lambda wildcards: [record["manifest"] for record in rounds_records(loop_of(wildcards))],
    output:
        summary=f"{RESULTS}/rounds/{{rounds_id}}/rounds.json",
        plot=report(
            f"{RESULTS}/rounds/{{rounds_id}}/return_vs_round.png",
            caption="../report/rounds.rst",
            category="Collection rounds",
            labels={"figure": "return against round", "loop": "{rounds_id}"},
        ),
    params:
        records=lambda wildcards: json.dumps(rounds_records(loop_of(wildcards))),
        name=lambda wildcards: f"rounds-{config['rounds']['experiment']}-{wildcards.rounds_id}",
        tracking=tracking_uri(),
    conda:
        "../envs/worldpipe.yaml"
    resources:
        **rule_resources("summarize_rounds"),
    log:
        f"{LOGS}/summarize_rounds/{{rounds_id}}.log",
    benchmark:
        f"{RULE_BENCHMARKS}/summarize_rounds/{{rounds_id}}.tsv"
    shell:
        "worldpipe rounds summarize --rounds-json {params.records:q} --name {params.name:q} --id {wildcards.rounds_id}"
        " --out {output.summary} --plot {output.plot} --tracking-uri {params.tracking:q} > {log} 2>&1"


# Time-to-quality across loop seeds: the return against real env steps and against the loop's wall-clock, median and
# 95% CI over the loops, with the env's published anchors as reference marks (worldpipe.control.time_to_quality).
rule summarize_time_to_quality:
    input:
        summaries=[f"{directory}/rounds.json" for directory in ROUNDS_DIRS],
    output:
        summary=f"{LOOPS_DIR}/time_to_quality.json",
        plot=report(
            f"{LOOPS_DIR}/time_to_quality.png",
            caption="../report/time_to_quality.rst",
            category="Collection rounds",
            labels={"figure": "time to quality", "loop": LOOPS_ID},
        ),
    params:
        name=f"loops-{config['rounds']['experiment']}-{LOOPS_ID.removeprefix('loops-')}" if LOOPS else "",
        loops_id=LOOPS_ID,
        tracking=tracking_uri(),
    conda:
        "../envs/worldpipe.yaml"
    resources:
        **rule_resources("summarize_time_to_quality"),
    log:
        f"{LOGS}/summarize_time_to_quality/{LOOPS_ID}.log",
    benchmark:
        f"{RULE_BENCHMARKS}/summarize_time_to_quality/{LOOPS_ID}.tsv"
    shell:
        "worldpipe rounds time-to-quality {input.summaries} --name {params.name:q} --id {params.loops_id}"
        " --out {output.summary} --plot {output.plot} --tracking-uri {params.tracking:q} > {log} 2>&1"
