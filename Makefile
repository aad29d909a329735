# The two commands a newcomer needs: `make run` and `make test`.
PYTHON ?= python3
# Where `make run` serves the portal.
PORT ?= 8000
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
AXE_CORE_VERSION := 4.14.1

# Tests run against real services: DATABASE_URL and CELERY_BROKER_URL when set, else these when they
# answer, else this checkout's embedded PostgreSQL and Redis under var/ (portal/embedded.py).
TEST_DATABASE_URL ?= postgres://postgres@127.0.0.1:5432/portal
TEST_BROKER_URL ?= redis://127.0.0.1:6379/0
EMBEDDED_OR_SYSTEM = $(BIN)/python -m portal.embedded exec --prefer-database $(TEST_DATABASE_URL) --prefer-broker $(TEST_BROKER_URL) --
# pytest-xdist processes; each test file runs whole in one of them (its own test database and queue).
# Most of the suite waits on workers, trainers and the browser, so three beat two cores' count.
TEST_WORKERS ?= 3
# Files whole, longest first (tests/durations.json) rather than xdist's most-tests-first.
PYTEST_XDIST = -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
# The fast tiers wait on nothing, so one process a core.
FAST_TEST_WORKERS ?= 2
# The loop fuzzes every API operation with fewer examples than `make test`'s 25, and without schemathesis'
# coverage phase (every field's boundary, missing and wrong-typed cases: four fifths of that file's time),
# which `make test` and CI run.
FAST_SCHEMATHESIS_EXAMPLES ?= 5

.PHONY: run test test-fast test-durations install check-deploy deploy-render clean

# Python writes bytecode here even where the environment says not to: the suite starts hundreds of Python
# processes (workers, trainers, servers, three pytest processes), and each would compile the portal's modules
# and rewrite the test modules' asserts again (about 6 s of every pytest process's collection).
unexport PYTHONDONTWRITEBYTECODE

$(STAMP): pyproject.toml sdk/pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[test,workloads,embedded]" -e ./sdk
	# axe-core for the accessibility test, pinned, from the npm registry; without npm the test uses the
	# older axe-core that axe-playwright-python bundles, and says so.
	if command -v npm >/dev/null; then npm install --prefix $(VENV)/axe --no-audit --no-fund --silent axe-core@$(AXE_CORE_VERSION); fi
	touch $(STAMP)

install: $(STAMP)

## Portal, worker and beat in the foreground, on embedded defaults. Ctrl-C stops all.
run: $(STAMP)
	$(BIN)/python manage.py up --addrport 127.0.0.1:$(PORT)

## Lint, then the whole test suite (unit, integration and e2e, as CI runs it) on PostgreSQL and Redis.
test: $(STAMP)
	$(BIN)/ruff check .
	API_LOGIN_RATE=10000/min $(EMBEDDED_OR_SYSTEM) \
	$(BIN)/python -m pytest $(PYTEST_XDIST) $(PYTEST_ARGS)

## Lint, then the unit and integration tiers only: no workers, browsers, stand-in or trainers.
test-fast: $(STAMP)
	$(BIN)/ruff check .
	API_LOGIN_RATE=10000/min SCHEMATHESIS_MAX_EXAMPLES=$(FAST_SCHEMATHESIS_EXAMPLES) SCHEMATHESIS_COVERAGE=0 $(EMBEDDED_OR_SYSTEM) \
	$(BIN)/python -m pytest -n $(FAST_TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "unit or integration" $(PYTEST_ARGS)

## The whole suite, writing each file's seconds into tests/durations.json (commit it: xdist starts the longest first).
test-durations: $(STAMP)
	API_LOGIN_RATE=10000/min $(EMBEDDED_OR_SYSTEM) \
	$(BIN)/python -m pytest $(PYTEST_XDIST) --write-durations $(PYTEST_ARGS)

## What `manage.py check --deploy` says under production settings.
check-deploy: $(STAMP)
	DEBUG=false SECRET_KEY=$$($(BIN)/python -c 'import secrets; print(secrets.token_urlsafe(50))') \
	ALLOWED_HOSTS=portal.example.com DATABASE_URL=postgres://check-reads-settings-only@127.0.0.1/portal \
	CELERY_BROKER_URL=redis://127.0.0.1:6379/0 $(BIN)/python manage.py check --deploy --fail-level WARNING

## The Kubernetes manifests of deploy/overlays/default, rendered (kubectl's built-in kustomize), on stdout.
deploy-render:
	@command -v kubectl >/dev/null 2>&1 || { echo "deploy-render needs kubectl (its built-in kustomize renders deploy/); install kubectl first." >&2; exit 1; }
	@kubectl kustomize deploy/overlays/default

clean:
	rm -rf $(VENV) var staticfiles
