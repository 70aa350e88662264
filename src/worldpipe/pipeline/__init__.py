"""What the Snakemake pipeline runs: the plan (datasets, runs, hashes), sweeps, and the index of runs."""
