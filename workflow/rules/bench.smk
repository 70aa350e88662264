# Benchmarks whose plots belong in the report; the settings of each are the config's `bench.NAME` section. They are
# not part of `all` (minutes of measurement). Build them and the report in one command:
#   snakemake --cores 2 collect_benchmarks --report-after-run --report results/report.html
# The settings are a param, so changing one benchmark's settings reruns that benchmark only.
import os
import shlex

from worldpipe.commands.bench import cli_options

BENCH = PATHS["bench"]
# `worldpipe bench NAME` options from the pipeline config, quoted for the shell (worldpipe.commands.bench).
BENCH_SETTINGS = config.get("bench", {})
# Each benchmark takes every core Snakemake is given (threads are capped at --cores): they measure speed, and two at
# once would disturb each other. Not workflow.cores: a cluster run has no --cores, and there the job's CPUs come
# from resources.<rule>.cpus_per_task when set.
BENCH_THREADS = os.cpu_count() or 1
# Benchmarks with one JSON and one plot of the same name (comm draws four plots: its own rule).
SINGLE_PLOT_BENCHMARKS = ("checkpoint", "rollout", "startup", "loop", "step", "compile", "pipeline", "activations")
# The report shows every benchmark in one category, labelled by benchmark and (comm's four plots) figure: two
# clicks to any plot.


rule measure_communication:
    output:
        result=f"{BENCH}/comm.json",
        allreduce=report(
            f"{BENCH}/comm_allreduce.png",
            caption="../report/bench_comm_allreduce.rst",
            category="Benchmarks",
            labels={"benchmark": "comm", "figure": "allreduce"},
        ),
        ring=report(
            f"{BENCH}/comm_ring_bytes.png",
            caption="../report/bench_comm_ring_bytes.rst",
            category="Benchmarks",
            labels={"benchmark": "comm", "figure": "ring bytes"},
        ),
        bubble=report(
            f"{BENCH}/comm_bubble.png",
            caption="../report/bench_comm_bubble.rst",
            category="Benchmarks",
            labels={"benchmark": "comm", "figure": "bubble"},
        ),
        memory=report(
            f"{BENCH}/comm_memory.png",
            caption="../report/bench_comm_memory.rst",
            category="Benchmarks",
            labels={"benchmark": "comm", "figure": "memory"},
        ),
    params:
        options=shlex.join(cli_options(BENCH_SETTINGS.get("comm", {}))),
    threads: BENCH_THREADS
    conda:
        "../envs/worldpipe.yaml"
    resources:
        **rule_resources("measure_communication"),
    log:
        f"{LOGS}/measure_communication/comm.log",
    benchmark:
        f"{RULE_BENCHMARKS}/measure_communication/comm.tsv"
    shell:
        "worldpipe bench comm {params.options} --out {output.result} > {log} 2>&1"


rule run_benchmark:
    output:
        result=f"{BENCH}/{{name}}.json",
        plot=report(
            f"{BENCH}/{{name}}.png",
            caption="../report/bench.rst",
            category="Benchmarks",
            labels={"benchmark": "{name}"},
        ),
    wildcard_constraints:
        name="|".join(SINGLE_PLOT_BENCHMARKS),
    params:
        options=lambda wildcards: shlex.join(cli_options(BENCH_SETTINGS.get(wildcards.name, {}))),
    threads: BENCH_THREADS
    conda:
        "../envs/worldpipe.yaml"
    resources:
        **rule_resources("run_benchmark"),
    log:
        f"{LOGS}/run_benchmark/{{name}}.log",
    benchmark:
        f"{RULE_BENCHMARKS}/run_benchmark/{{name}}.tsv"
    shell:
        "worldpipe bench {wildcards.name} {params.options} --out {output.result} > {log} 2>&1"


# `worldpipe plan` against measurement: the plot and the predicted-vs-measured table (HTML), both in the report.
rule measure_plan:
    output:
        result=f"{BENCH}/plan.json",
        plot=report(
            f"{BENCH}/plan.png",
            caption="../report/bench_plan.rst",
            category="Benchmarks",
            labels={"benchmark": "plan", "figure": "memory ratio"},
        ),
        table=report(
            f"{BENCH}/plan.html",
            caption="../report/bench_plan_table.rst",
            category="Benchmarks",
            labels={"benchmark": "plan", "figure": "predicted vs measured table"},
        ),
        csv=f"{BENCH}/plan.csv",
    params:
        options=shlex.join(cli_options(BENCH_SETTINGS.get("plan", {}))),
    threads: BENCH_THREADS
    conda:
        "../envs/worldpipe.yaml"
    resources:
        **rule_resources("run_benchmark"),  # a benchmark like the others: their cluster requests
    log:
        f"{LOGS}/measure_plan/plan.log",
    benchmark:
        f"{RULE_BENCHMARKS}/measure_plan/plan.tsv"
    shell:
        "worldpipe bench plan {params.options} --out {output.result} > {log} 2>&1"


# Every benchmark's JSON and plots (the target of `snakemake collect_benchmarks`).
rule collect_benchmarks:
    input:
        rules.measure_communication.output,
        rules.measure_plan.output,
        expand(rules.run_benchmark.output, name=SINGLE_PLOT_BENCHMARKS),
