"""Snakemake script: every experiment's held-out error ratio against the repeat-last baseline, on one plot."""

import json
import sys
from pathlib import Path

from worldpipe.evaluate.open_loop import plot_models_vs_baseline

snakemake = globals()["snakemake"]  # injected by Snakemake's script directive
sys.stderr = open(snakemake.log[0], "w")  # noqa: SIM115 - the log must stay open for the whole script

results = {}
for label, path in zip(snakemake.params.labels, snakemake.input.metrics, strict=True):
    results[label] = json.loads(Path(path).read_text())  # labelled by experiment and run hash
plot_models_vs_baseline(results, snakemake.output.plot)
