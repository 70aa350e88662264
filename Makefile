# The two quick-start commands: `make pipeline` and `make test`. Each installs what it needs first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PROFILE ?= workflow/profiles/workstation
CONFIGFILE ?=
SNAKE_ARGS := --profile $(PROFILE) $(if $(CONFIGFILE),--configfile $(CONFIGFILE),)

.PHONY: install system-deps pipeline report figures test lint docs gpu-check

$(BIN)/worldpipe: requirements.lock pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -r requirements.lock -e .
	$(BIN)/python -m worldpipe.models.native
	touch $@

install: $(BIN)/worldpipe

# Debian packages the tests drive (strace, fault injection, SLURM, Chromium); a no-op when present.
system-deps:
	bash .ci/system-deps.sh

pipeline: install
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/snakemake $(SNAKE_ARGS)
	$(MAKE) report

# The report of what the last successful pipeline run made, whatever its config (recorded by that run); with
# CONFIGFILE=..., that config's results instead.
report: install
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/snakemake $(if $(CONFIGFILE),--configfile $(CONFIGFILE),) --report results/report.html

# The docs' figures (docs/assets/*.png and the JSON naming their runs), drawn again from the current config's runs
# that `make pipeline` left in results/.
figures: install
	$(BIN)/worldpipe figures

# --no-skips: a tier that cannot run here (no SLURM cluster, no strace, ...) fails the target instead of skipping.
# Two xdist workers, one per core (docs/testing.md says why not three); tests/conftest.py groups the tests so each
# module's fixtures, the SLURM cluster and the docs pipelines are built once.
TEST_WORKERS ?= 2
test: install system-deps
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/ruff check src tests benchmarks workflow
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/snakemake --lint
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/pytest -m "slow or not slow" --no-skips --durations=40 \
		-n $(TEST_WORKERS) --dist loadgroup

lint: install
	$(BIN)/ruff check src tests benchmarks workflow
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/snakemake --lint

# The documentation site (mkdocs.yml, docs/) into site/; --strict: a broken link, #anchor or page left out of the
# nav fails the build (tests/project/test_docs_site.py builds it the same way).
docs: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# The device check (tests/gpu/gpu_check.py): CUDA training, kill -9 and resume, rerun from records, pixels; run by
# hand where a GPU is. Where none is it fails with one line: no CI machine has one, so it is not part of `test`.
gpu-check: install
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/python tests/gpu/gpu_check.py
