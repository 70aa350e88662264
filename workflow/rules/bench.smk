# Benchmarks whose plots belong in the report. Not part of `all` (minutes of measurement): build them with
#   snakemake --cores 2 bench_comm && snakemake --report results/report.html all bench_comm   (targets before --configfile)


rule bench_comm:
    output:
        result="results/bench/comm.json",
        allreduce=report("results/bench/comm_allreduce.png", caption="../report/bench_comm.rst", category="Benchmarks"),
        ring=report("results/bench/comm_ring_bytes.png", caption="../report/bench_comm.rst", category="Benchmarks"),
        bubble=report("results/bench/comm_bubble.png", caption="../report/bench_comm.rst", category="Benchmarks"),
        memory=report("results/bench/comm_memory.png", caption="../report/bench_comm.rst", category="Benchmarks"),
    params:
        nproc=2,
    conda:
        "../envs/worldpipe.yaml"
    resources:
        **rule_resources("bench_comm"),
    log:
        "logs/bench_comm/bench_comm.log",
    benchmark:
        "benchmarks/rules/bench_comm/bench_comm.tsv"
    shell:
        "worldpipe bench comm --nproc {params.nproc} --out {output.result} > {log} 2>&1"
