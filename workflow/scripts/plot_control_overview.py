"""Snakemake script: every experiment's closed-loop return beside random, the behaviour policy and the ceiling."""

import json
import sys
from pathlib import Path

from worldpipe.control.report import plot_control_overview

snakemake = globals()["snakemake"]  # injected by Snakemake's script directive
sys.stderr = open(snakemake.log[0], "w")  # noqa: SIM115 - the log must stay open for the whole script

records = {label: json.loads(Path(path).read_text())
           for label, path in zip(snakemake.params.labels, snakemake.input.records, strict=True)}
plot_control_overview(records, snakemake.output.plot)
