# Data-collection rounds (config `rounds`, see src/worldpipe/pipeline/rounds.py). Round k >= 1's dataset is built by
# the data rules (init_store waits for round k-1's training, simulate_episodes collects with its model), and its run
# by train_model, evaluate_model and evaluate_control like any run; this file adds only the loop's summary: the
# return against round, and the rounds nested under one MLflow parent run.
ROUNDS_ID = rounds_id(ROUNDS) if ROUNDS else "none"
ROUNDS_DIR = paths.rounds_dir(ROUNDS_ID, Path(CONF_DIR))


rule summarize_rounds:
    input:
        metrics=[record["metrics"] for record in rounds_records()],
        control=[record["control"] for record in rounds_records()],
        manifests=[record["manifest"] for record in rounds_records()],
    output:
        summary=f"{ROUNDS_DIR}/rounds.json",
        plot=report(
            f"{ROUNDS_DIR}/return_vs_round.png",
            caption="../report/rounds.rst",
            category="Collection rounds",
            labels={"figure": "return against round"},
        ),
    params:
        records=json.dumps(rounds_records()),
        name=f"rounds-{config['rounds']['experiment']}-{ROUNDS_ID}" if ROUNDS else "",
        rounds_id=ROUNDS_ID,
        tracking=tracking_uri(),
    conda:
        "../envs/worldpipe.yaml"
    resources:
        **rule_resources("summarize_rounds"),
    log:
        f"{LOGS}/summarize_rounds/{ROUNDS_ID}.log",
    benchmark:
        f"{RULE_BENCHMARKS}/summarize_rounds/{ROUNDS_ID}.tsv"
    shell:
        "worldpipe rounds summarize --rounds-json {params.records:q} --name {params.name:q} --id {params.rounds_id}"
        " --out {output.summary} --plot {output.plot} --tracking-uri {params.tracking:q} > {log} 2>&1"
