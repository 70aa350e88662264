# Episodes -> zarr v3 shards -> manifest, in <data>/<dataset>/<spec-hash>/. Fan out one job per shard range,
# fan in to seal. A changed spec is a new directory beside the old one.


rule init_store:
    input:
        collector_inputs,  # a collection round's collecting run and its data; nothing for a scripted policy's
    output:
        store=directory(f"{DATA}/{{dataset}}/{{spec_hash}}/{paths.STORE_NAME}"),
        record=f"{DATA}/{{dataset}}/{{spec_hash}}/parts/init.json",
    params:
        spec=spec_json,
    conda:
        "../envs/worldpipe.yaml"
    resources:
        **rule_resources("init_store"),
    log:
        f"{LOGS}/init_store/{{dataset}}-{{spec_hash}}.log",
    benchmark:
        f"{RULE_BENCHMARKS}/init_store/{{dataset}}-{{spec_hash}}.tsv"
    shell:
        "(worldpipe data init --spec {params.spec:q} --store {output.store}"
        " && echo {params.spec:q} > {output.record}) > {log} 2>&1"


rule simulate_episodes:
    # The store is a parameter, not an input: every part job writes shards into it, so its newest file is
    # younger than the parts finished first, which an input's modification time would count as a change.
    input:
        init=rules.init_store.output.record,
    output:
        record=f"{DATA}/{{dataset}}/{{spec_hash}}/parts/part-{{part}}.json",
    params:
        store=rules.init_store.output.store,
        spec=spec_json,
        shards=shard_range,
    conda:
        "../envs/worldpipe.yaml"
    resources:
        **rule_resources("simulate_episodes"),
    log:
        f"{LOGS}/simulate_episodes/{{dataset}}-{{spec_hash}}-{{part}}.log",
    benchmark:
        f"{RULE_BENCHMARKS}/simulate_episodes/{{dataset}}-{{spec_hash}}-{{part}}.tsv"
    shell:
        "worldpipe data write --spec {params.spec:q} --store {params.store} --shards {params.shards}"
        " > {output.record} 2> {log}"


rule seal_dataset:
    input:
        parts=part_records,
    output:
        manifest=f"{DATA}/{{dataset}}/{{spec_hash}}/{paths.MANIFEST_NAME}",
    params:
        store=rules.init_store.output.store,
    conda:
        "../envs/worldpipe.yaml"
    resources:
        **rule_resources("seal_dataset"),
    log:
        f"{LOGS}/seal_dataset/{{dataset}}-{{spec_hash}}.log",
    benchmark:
        f"{RULE_BENCHMARKS}/seal_dataset/{{dataset}}-{{spec_hash}}.tsv"
    shell:
        "worldpipe data seal --store {params.store} --manifest {output.manifest} > {log} 2>&1"
