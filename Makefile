# The two commands a newcomer runs: `make run` (compile the embedded default model and serve it) and
# `make test` (the test suite). Both install what they need, idempotently, into .venv.
SHELL := /bin/bash
# pipefail: a recipe whose pipeline fails anywhere (a failed compile piped into tail) stops make.
.SHELLFLAGS := -eo pipefail -c
VENV ?= .venv
PY := $(VENV)/bin/python
SHARED_MODEL := ../shared/models/stories260K
# The embedded default: the real stories260K checkpoint when the shared folder is beside the clone,
# otherwise a tiny randomly initialised Llama that the project generates itself (random weights).
MODEL ?= $(if $(wildcard $(SHARED_MODEL)/config.json),$(SHARED_MODEL),random:tiny)
ARTIFACTS ?= artifacts
# A random-weight default is served on purpose: the server refuses random weights unless told.
ALLOW_RANDOM_WEIGHTS ?= $(if $(filter random:%,$(MODEL)),--allow-random-weights,)
PORT ?= 8000

.PHONY: install system-deps run test lint

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	# torch first, pinned to the local CPU build, so no later requirement pulls a CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

install: $(VENV)/.installed

# Real servers the integration tests drive (Debian packages): nginx and promtool. Checked by their
# packages' paths: /usr/sbin is not on a non-root user's PATH.
system-deps:
	@test -x /usr/sbin/nginx && test -x /usr/bin/promtool || { \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx-light prometheus >/dev/null; }

# compile prints the artifact's path as its last stdout line.
run: install
	artifact="$$($(VENV)/bin/inf2serve compile --model $(MODEL) --output $(ARTIFACTS) | tail -n 1)" && \
	  exec $(VENV)/bin/inf2serve serve --artifact "$$artifact" --host 127.0.0.1 --port $(PORT) $(ALLOW_RANDOM_WEIGHTS)

# ruff (`lint`) and lint-imports (the import contracts in pyproject.toml, [tool.importlinter]) take
# seconds, so they run first.
test: lint system-deps
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q

# ruff is pinned (pyproject.toml): a new release may check or format differently.
lint: install
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .
