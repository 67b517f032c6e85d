# kimi-supervisor. `make test` and `make demo` do all set-up on a fresh Debian 12 machine (root).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup test lint typecheck pytest unit bench demo clean install uninstall deb package

# `make install` (as root, for development; a host installs the Debian package of `make deb`):
# the package in its own virtualenv under PREFIX, built from the hash-pinned locks, the commands
# in BINDIR, the units, sysusers.d and tmpfiles.d under /usr/local, the config (kept if present)
# and the docs. DESTDIR stages it elsewhere (the tests); then nothing is activated.
# `make uninstall` takes the same variables and removes it all but the config and the state.
PREFIX ?= /opt/kimi-supervisor
BINDIR ?= /usr/local/bin
UNITDIR ?= /usr/local/lib/systemd/system
SYSCONFDIR ?= /etc
MANDIR ?= /usr/local/share/man
DESTDIR ?=

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml scripts/setup-system.sh
	sh scripts/setup-system.sh
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

lint: setup
	$(BIN)/ruff check kimi_supervisor tests bench ansible
	$(BIN)/ruff format --check kimi_supervisor tests bench ansible
	$(BIN)/lint-imports

typecheck: setup
	$(BIN)/mypy kimi_supervisor

# The tests: the unit tier on both cores (`make unit`), then every other tier in one session (a
# session's fixtures are shared: one package build, one sandbox), whatever the first's outcome,
# one test at a time. TIER_WORKERS=2 runs them on two pytest-xdist workers instead, the heavy
# tiers (a real vLLM, the Debian package and its booted hosts) one after the other on one
# worker and the sandbox tier beside them (tests/conftest.py, "the tiers side by side"): 42-45
# min where one at a time took 68-74 in CI. CI runs them one at a time until that passes three
# times in a row under load (docs/development.md, "The test tiers"). A short temporary folder,
# kept when one failed.
TIER_WORKERS ?= 0

pytest: setup
	rc=0; $(MAKE) --no-print-directory unit || rc=$$?; \
	  d="$$(mktemp -d /tmp/kimi-tiers.XXXXXX)" && \
	  { $(BIN)/pytest -q $(if $(filter-out 0,$(TIER_WORKERS)),-n $(TIER_WORKERS) --dist loadgroup) \
	      --basetemp="$$d" --durations=25 --ignore=tests/unit || rc=$$?; } && \
	  if [ "$$rc" -eq 0 ]; then rm -rf "$$d"; fi; exit $$rc

# The fast layer alone: pure logic per wing, the loop in-process, the import layers, on two
# workers (pytest-xdist) in a short temporary folder (a socket's path has 108 bytes at most),
# removed when every test passed and kept for a look otherwise. Measured on a quiet 2-core
# machine: see docs/development.md, "The test tiers".
# The unit tier on two workers, then its real-terminal tests alone: a terminal watched in real
# time beside another worker's load misses what it watches for. A session a -k selection leaves
# empty (pytest's exit 5) is no failure.
unit: setup
	d="$$(mktemp -d /tmp/kimi-unit.XXXXXX)" && rc=0 && \
	  { $(BIN)/pytest -q -n 2 --basetemp="$$d" -m "not terminal" tests/unit || \
	    { s=$$?; [ "$$s" -eq 5 ] || rc=$$s; }; } && \
	  { $(BIN)/pytest -q --basetemp="$$d/terminal" -m terminal tests/unit || \
	    { s=$$?; [ "$$s" -eq 5 ] || rc=$$s; }; } && \
	  if [ "$$rc" -eq 0 ]; then rm -rf "$$d"; fi && exit $$rc

# The whole suite: lint (with the import layers), types, tests (real systemd user manager, real processes, simulated GPUs).
test: lint typecheck pytest

# Every sandbox benchmark, each recording its run in bench/results/ and refilling its section of
# docs/performance.md (bench/perf_tables.py; about 12 minutes).
bench: setup
	$(BIN)/python -m bench.teardown_bench --runs 5 --gpus 8 --write docs/performance.md
	$(BIN)/python -m bench.practice_bench --runs 3 --write docs/performance.md
	$(BIN)/python -m bench.scale_bench --runs 5 --write docs/performance.md
	$(BIN)/python -m bench.daemon_bench --idle-s 60 --runs 5 --write docs/performance.md
	$(BIN)/python -m bench.faults_bench --runs 200 --write docs/performance.md
	$(BIN)/python -m bench.scrape_bench --seconds 12 --write docs/performance.md
	$(BIN)/python -m bench.fleet_bench --hosts 3 --runs 3 --write docs/performance.md
	$(BIN)/python -m bench.package_bench --runs 1 --write docs/performance.md
	$(BIN)/python -m bench.bounded_bench --runs 7 --write docs/performance.md

# The main job: the sandbox demo (a real systemd user manager, 8 simulated GPUs, the daemon).
demo: setup
	bash scripts/demo.sh

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache

install:
	sh scripts/install.sh "$(DESTDIR)" "$(PREFIX)" "$(BINDIR)" "$(UNITDIR)" "$(SYSCONFDIR)" /usr/bin/python3 "$(MANDIR)"

uninstall:
	sh scripts/uninstall.sh "$(DESTDIR)" "$(PREFIX)" "$(BINDIR)" "$(UNITDIR)" "$(SYSCONFDIR)" "$(MANDIR)"

# The Debian package, in dist/ (docs/operations.md installs it). Build tools: setup-system.sh --package.
deb package:
	sh scripts/setup-system.sh --package
	sh scripts/build-deb.sh
