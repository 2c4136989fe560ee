# make run   - create .venv if missing, install, migrate, ensure the demo login, serve
# make test  - install the dev extras, lint, typecheck, run the tests (two passes, see below)
#
# Both use the virtualenv .venv at the project root and reinstall only when pyproject.toml
# changes (a stamp file named after its checksum).

SHELL := /bin/bash
.DEFAULT_GOAL := help

VENV := .venv
BIN := $(VENV)/bin
PORT ?= 8000
PYTEST_ARGS ?=

# The interpreter that creates .venv: the first of these that is Python >= 3.11.
# Override with `make run PYTHON=/path/to/python3.12`.
PYTHON ?= $(shell for p in python3 python3.13 python3.12 python3.11; do \
	command -v $$p >/dev/null 2>&1 && \
	$$p -c 'import sys; sys.exit(sys.version_info < (3, 11))' >/dev/null 2>&1 && \
	{ echo $$p; break; }; done)

STAMP_ID := $(shell cksum < pyproject.toml | cut -d' ' -f1)
RUN_STAMP := $(VENV)/.installed-run-$(STAMP_ID)
DEV_STAMP := $(VENV)/.installed-dev-$(STAMP_ID)

.PHONY: help venv install install-dev run run-scaled scaled-check migrate demo-user lint format \
	typecheck test clean

help:
	@echo "make run        serve on http://127.0.0.1:$(PORT) (embedded mode unless DATABASE_URL/REDIS_URL)"
	@echo "make run-scaled scaled mode: two servers (8001, 8002), a Celery worker and beat under honcho;"
	@echo "                needs DATABASE_URL (PostgreSQL) and REDIS_URL (Redis)"
	@echo "make test       lint, typecheck and the whole test suite (PYTEST_ARGS=... to narrow)"
	@echo "make lint       ruff format --check, ruff check and the import contract (lint-imports)"
	@echo "make format     ruff format and ruff check --fix"
	@echo "make typecheck  mypy"
	@echo "make migrate    apply database migrations"
	@echo "make venv       create .venv and install the project with its dev extras"

# --- virtualenv -------------------------------------------------------------------------------

$(BIN)/python:
	@if [ -z "$(PYTHON)" ]; then \
		echo "error: Python >= 3.11 is required to create $(VENV), but none was found" \
			"(tried python3, python3.13, python3.12, python3.11; found:" \
			"$$(python3 --version 2>/dev/null || echo 'no python3'))." >&2; \
		echo "Install Python 3.11 or newer, or point to one: make $(MAKECMDGOALS) PYTHON=/path/to/python3.x" >&2; \
		exit 1; \
	fi
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { \
		echo "error: $(PYTHON) is $$($(PYTHON) --version 2>&1); Python >= 3.11 is required." >&2; \
		exit 1; }
	@echo "Creating $(VENV) with $$($(PYTHON) --version 2>&1) ($(PYTHON))"
	$(PYTHON) -m venv $(VENV)

$(RUN_STAMP): | $(BIN)/python
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e .
	@rm -f $(VENV)/.installed-run-*
	@touch $@

$(DEV_STAMP): | $(BIN)/python
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[dev]'
	@rm -f $(VENV)/.installed-run-* $(VENV)/.installed-dev-*
	@touch $@ $(RUN_STAMP)

install: $(RUN_STAMP)
install-dev: $(DEV_STAMP)
venv: install-dev

# --- run --------------------------------------------------------------------------------------

migrate: $(RUN_STAMP)
	$(BIN)/python manage.py migrate --noinput

demo-user: migrate
	@$(BIN)/python manage.py ensure_demo_user --staff --port $(PORT)

run: demo-user
	$(BIN)/python manage.py serve --port $(PORT)

# Scaled mode (README "Scaled mode"): check that PostgreSQL and Redis answer, migrate, then the
# Procfile's processes under honcho (Ctrl-C stops them all). Ports: SERVE_PORT_1/SERVE_PORT_2.
scaled-check: $(RUN_STAMP)
	@$(BIN)/python manage.py scaled_check

run-scaled: scaled-check
	$(BIN)/python manage.py migrate --noinput
	@$(BIN)/python manage.py ensure_demo_user --port $${SERVE_PORT_1:-8001}
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/honcho -f Procfile start

# --- checks -----------------------------------------------------------------------------------

lint: $(DEV_STAMP)
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
	$(BIN)/lint-imports

format: $(DEV_STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

typecheck: $(DEV_STAMP)
	$(BIN)/mypy .

# Pass 1: the whole suite (but the PostgreSQL-only tests) on SQLite in embedded mode; tests
# about Redis or PostgreSQL get the real services through TEST_REDIS_URL / TEST_DATABASE_URL.
# Pass 2 (only with DATABASE_URL): the `both_dbs` and `postgres` tests on PostgreSQL. In CI
# (CI=true) a missing DATABASE_URL fails: CI must run the PostgreSQL tests.
# The outer URLs are saved first: `DATABASE_URL= X=$$DATABASE_URL cmd` would pass an empty X.
test: lint typecheck
	@db="$$DATABASE_URL"; redis="$$REDIS_URL"; \
	echo "== pytest pass 1: whole suite except -m postgres, on SQLite (embedded mode);" \
		"Redis tests $$([ -n "$$redis" ] && echo 'on REDIS_URL' || echo 'skipped: REDIS_URL not set') =="; \
	DATABASE_URL= REDIS_URL= TEST_DATABASE_URL="$$db" TEST_REDIS_URL="$$redis" \
		$(BIN)/pytest -m "not postgres" $(PYTEST_ARGS)
	@db="$$DATABASE_URL"; redis="$$REDIS_URL"; \
	if [ -n "$$db" ]; then \
		shown=$$(printf '%s' "$$db" | sed -E 's#//[^/@]*@#//***@#'); \
		echo "== pytest pass 2: -m 'both_dbs or postgres' on PostgreSQL ($$shown) =="; \
		DATABASE_URL="$$db" REDIS_URL= TEST_REDIS_URL="$$redis" TEST_DATABASE_URL="$$db" \
			$(BIN)/pytest -m "both_dbs or postgres" $(PYTEST_ARGS); rc=$$?; \
		if [ $$rc -eq 5 ]; then echo "== pytest pass 2: no test selected; nothing to run =="; rc=0; fi; \
		exit $$rc; \
	elif [ "$$CI" = "true" ]; then \
		echo "error: pytest pass 2 (PostgreSQL) cannot run: DATABASE_URL is not set, and CI must run it." >&2; \
		exit 1; \
	else \
		echo "== pytest pass 2 (PostgreSQL) skipped: DATABASE_URL is not set =="; \
	fi

clean:
	rm -rf .pytest_cache .mypy_cache .ruff_cache
