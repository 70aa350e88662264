# Episodes -> zarr v3 shards -> manifest. Fan out one job per shard range, fan in to seal.


rule init_store:
    output:
        record="results/data/{dataset}/parts/init.json",
    params:
        spec=spec_json,
        store="results/data/{dataset}/store.zarr",
    conda:
        "../envs/worldpipe.yaml"
    resources:
        **rule_resources("init_store"),
    log:
        "logs/init_store/{dataset}.log",
    benchmark:
        "benchmarks/rules/init_store/{dataset}.tsv"
    shell:
        "(rm -rf {params.store} && worldpipe data init --spec {params.spec:q} --store {params.store}"
        " && echo {params.spec:q} > {output.record}) > {log} 2>&1"


rule simulate_episodes:
    input:
        init="results/data/{dataset}/parts/init.json",
    output:
        record="results/data/{dataset}/parts/part-{part}.json",
    params:
        spec=spec_json,
        store="results/data/{dataset}/store.zarr",
        shards=shard_range,
    conda:
        "../envs/worldpipe.yaml"
    resources:
        **rule_resources("simulate_episodes"),
    log:
        "logs/simulate_episodes/{dataset}-{part}.log",
    benchmark:
        "benchmarks/rules/simulate_episodes/{dataset}-{part}.tsv"
    shell:
        "worldpipe data write --spec {params.spec:q} --store {params.store} --shards {params.shards}"
        " > {output.record} 2> {log}"


rule seal_dataset:
    input:
        parts=part_records,
    output:
        manifest="results/data/{dataset}/manifest.json",
    params:
        store="results/data/{dataset}/store.zarr",
    conda:
        "../envs/worldpipe.yaml"
    resources:
        **rule_resources("seal_dataset"),
    log:
        "logs/seal_dataset/{dataset}.log",
    benchmark:
        "benchmarks/rules/seal_dataset/{dataset}.tsv"
    shell:
        "worldpipe data seal --store {params.store} --manifest {output.manifest} > {log} 2>&1"
