# Two entry points: `make serve` and `make test`. Both build .venv first when it is missing
# or older than requirements.txt (the stamp file records the last successful install).

VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The project targets Python 3.11: the distribution's own build where it has one (optimised;
# scripts/bootstrap-python.sh says why), else python3.11 on PATH, else python3.
# `make venv PYTHON=/path/to/python3.11` chooses another.
BOOTSTRAP_PYTHON := $(shell PYTHON="$(PYTHON)" sh scripts/bootstrap-python.sh)

PYTEST_ARGS ?=
SERVE_ARGS ?=

.PHONY: serve test lint venv

venv: $(STAMP)

$(STAMP): requirements.txt
	test -x $(PY) || $(BOOTSTRAP_PYTHON) -m venv $(VENV)
	$(PY) -m pip install -r requirements.txt
	touch $(STAMP)

serve: $(STAMP)
	$(PY) -m engine.paged_kernel
	$(PY) -m apps.routing.decision.index
	$(PY) manage.py migrate --noinput
	$(PY) manage.py serve $(SERVE_ARGS)

test: $(STAMP)
	$(PY) -m engine.paged_kernel
	$(PY) -m apps.routing.decision.index
	$(PY) -m pytest -q -p no:cacheprovider --durations=25 $(PYTEST_ARGS)

# ruff's configuration is in pyproject.toml; CI runs this before the tests
lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
