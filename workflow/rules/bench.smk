# Benchmarks as report targets (not part of `rule all`): `snakemake results/bench/rollout.png`, then
# `snakemake --report ... results/bench/rollout.png` shows the plot. Names: rollout, startup, loop.


rule run_benchmark:
    output:
        result=f"{RESULTS}/bench/{{name}}.json",
        plot=report(
            f"{RESULTS}/bench/{{name}}.png",
            caption="../report/bench.rst",
            category="Benchmarks",
            subcategory="{name}",
        ),
    wildcard_constraints:
        name="rollout|startup|loop",
    conda:
        "../envs/worldpipe.yaml"
    resources:
        **rule_resources("run_benchmark"),
    log:
        f"{LOGS}/run_benchmark/{{name}}.log",
    benchmark:
        f"{RULE_BENCHMARKS}/run_benchmark/{{name}}.tsv"
    shell:
        "worldpipe bench {wildcards.name} --out {output.result} > {log} 2>&1"
