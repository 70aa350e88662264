# The two quick-start commands: `make pipeline` and `make test`. Each installs what it needs first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PROFILE ?= workflow/profiles/workstation
CONFIGFILE ?=
SNAKE_ARGS := --profile $(PROFILE) $(if $(CONFIGFILE),--configfile $(CONFIGFILE),)

.PHONY: install system-deps pipeline report test lint

$(BIN)/worldpipe: requirements.lock pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -r requirements.lock -e .
	touch $@

install: $(BIN)/worldpipe

# Debian packages the tests drive (strace, fault injection, SLURM, Chromium); a no-op when present.
system-deps:
	bash .ci/system-deps.sh

pipeline: install
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/snakemake $(SNAKE_ARGS)
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/snakemake $(SNAKE_ARGS) --report results/report.html

# --no-skips: a tier that cannot run here (no SLURM cluster, no strace, ...) fails the target instead of skipping.
test: install system-deps
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/ruff check src tests benchmarks workflow
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/snakemake --lint
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/pytest -m "slow or not slow" --no-skips --durations=40

lint: install
	$(BIN)/ruff check src tests benchmarks workflow
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/snakemake --lint
