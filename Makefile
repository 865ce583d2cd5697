# Workbench: two commands set everything up on a fresh machine.
#   make lab    create .venv, install workbench (+ lab extension), open JupyterLab on notebooks/
#   make test   create/refresh .venv when needed, install test tools, run every test
#   make test-fast   every test but the heavy ones (markers in pyproject.toml): the edit-test loop
SHELL := /bin/bash
# The Python of .venv: JAX 0.11+ and Flax 0.12.12 need 3.12+. tools/find-python.sh takes
# python3 where it is 3.12+, else python3.12/3.13/3.14 or a pyenv version; PYTHON=... chooses.
ifeq ($(origin PYTHON),undefined)
PYTHON := $(shell sh tools/find-python.sh)
endif
ifeq ($(PYTHON),)
$(error make: Workbench needs Python 3.12 or newer (JAX 0.11+ and Flax 0.12.12 do), and   found none (python3 is $(shell python3 --version 2>&1)); install one, or pass PYTHON=/path/to/python3.12)
endif
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Where no accelerator exists, JAX gets 8 simulated CPU devices (harmless on GPU/TPU).
export XLA_FLAGS ?= --xla_force_host_platform_device_count=8
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: lab test test-fast tpu-plans bench browser clusters system-packages setup install clean \
	screenshots

# The extension's npm packages exactly as the committed lockfile pins them: `npm ci` never
# rewrites labextension/package-lock.json (it fails if package.json disagrees with it; then
# run `npm install` in labextension/ and commit the lockfile it writes).
NODE_STAMP := labextension/node_modules/.installed
$(NODE_STAMP): labextension/package.json labextension/package-lock.json
	cd labextension && npm ci --no-audit --no-fund
	touch $@

# pip installs without byte-compiling: compiling the ~190 packages was ~38 s of one core,
# the longest step of a fresh `make test`'s set-up, for files most processes never import.
# Python writes a module's bytecode when it first imports it, unless the environment sets
# PYTHONDONTWRITEBYTECODE=1 (this machine's does): then every process (each kernel, each job
# worker) compiles JAX, Flax, Orbax and Grain from source again, 3.7 s of CPU to import them
# with the Trainer instead of 1.5 s. So the tests run without that setting (PYTEST below) and
# write the bytecode of what they import, once; `make lab` keeps the user's setting, and
# where it is set byte-compiles the environment once first, on every core (LAB_BYTECODE).
# Two steps, so that the first runs beside `npm ci` under `make -j` (`setup`): the
# dependencies (pyproject.toml's, read by tools/requirements.py), then Workbench itself,
# whose editable wheel builds labextension/ with npm and so needs its packages.
#
# The accelerator's JAX (tools/accelerator.py; workbench/hardware/_accelerator.py says how):
# JAX's CUDA plugin for the driver's CUDA major version where nvidia-smi lists NVIDIA GPUs
# (the pyproject extras cuda12 / cuda13), libtpu on a Cloud TPU VM (installed everywhere, for
# TPU-compiled plans), the CPU build elsewhere. ACCEL=cpu|cuda12|cuda13|tpu overrides; the first
# line make prints says what was chosen and why. Each choice has its own stamp, so changing it
# installs again, and a CPU/TPU choice removes a CUDA plugin an earlier choice installed.
ACCEL_LINE := $(shell ACCEL="$(ACCEL)" $(PYTHON) tools/accelerator.py)
ACCEL_CHOICE := $(firstword $(ACCEL_LINE))
ifeq ($(ACCEL_CHOICE),)
$(error make: tools/accelerator.py printed nothing (is $(PYTHON) Python 3.12+?))
endif
ifeq ($(ACCEL_CHOICE),error)
$(error make: $(wordlist 2,999,$(ACCEL_LINE)))
endif
ifneq ($(filter-out clean,$(or $(MAKECMDGOALS),lab)),)
$(info $(wordlist 2,999,$(ACCEL_LINE)))
endif
CUDA_PLUGINS := jax-cuda12-plugin jax-cuda12-pjrt jax-cuda13-plugin jax-cuda13-pjrt
comma := ,
EXTRAS := test,tpu-compile$(if $(filter cuda%,$(ACCEL_CHOICE)),$(comma)$(ACCEL_CHOICE))
DEPS_STAMP := $(VENV)/.deps-$(ACCEL_CHOICE)
# A .venv made with an older Python (before JAX 0.11) is made again: its packages cannot move.
# tools/lock.txt holds the JAX stack at the versions CI tests (pip constraints).
VENV_PYTHON_OK = $(BIN)/python -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null
$(DEPS_STAMP): pyproject.toml tools/requirements.py tools/lock.txt
	$(VENV_PYTHON_OK) || { test ! -e $(VENV) || echo "make: $(VENV) has Python \
	  $$($(BIN)/python -c 'import platform; print(platform.python_version())' 2>/dev/null), \
	  Workbench now needs 3.12+: making it again with $(PYTHON)"; rm -rf $(VENV); }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/python tools/requirements.py $(EXTRAS) > $(VENV)/requirements.txt
	$(BIN)/pip uninstall -y -q $(filter-out $(ACCEL_CHOICE:cuda%=jax-cuda%-plugin) \
	  $(ACCEL_CHOICE:cuda%=jax-cuda%-pjrt),$(CUDA_PLUGINS)) 2>/dev/null || true
	$(BIN)/pip install --no-compile -c tools/lock.txt -r $(VENV)/requirements.txt
	rm -f $(VENV)/.deps-*
	touch $@

$(STAMP): $(DEPS_STAMP) $(NODE_STAMP) $(wildcard labextension/package.json labextension/src/*.ts labextension/style/* labextension/schema/*)
	$(BIN)/pip install -c tools/lock.txt -e ".[$(EXTRAS)]"
	touch $(STAMP)

install: $(STAMP)

# jupyter_server refuses to start as root (containers, fresh cloud and TPU VMs) without
# --allow-root, so `make lab` passes it when, and only when, it runs as root. LAB_ARGS comes
# last: it adds to or overrides everything before it (e.g. LAB_ARGS="--no-browser --port=8888").
LAB_ROOT_ARGS = $(if $(filter 0,$(shell id -u)),--allow-root)
LAB_ROOT_WHY := make lab: running as root, so passing --allow-root (jupyter_server refuses root without it)
# compileall's exit status is 1 where a package ships a file that is not Python 3 (test
# fixtures; pip's byte-compiling skips the same files), and a user who cannot write .venv
# starts the lab without its bytecode: neither stops `make lab`.
LAB_BYTECODE := $(if $(PYTHONDONTWRITEBYTECODE),$(VENV)/.bytecode)
$(VENV)/.bytecode: $(STAMP)
	@echo "make lab: PYTHONDONTWRITEBYTECODE is set, so byte-compiling .venv once for the kernels"
	$(BIN)/python -m compileall -qq -j 0 $$($(BIN)/python -c \
	  "import sysconfig; print(sysconfig.get_paths()['purelib'])") || true
	touch $@ || true

lab: $(STAMP) $(LAB_BYTECODE)
	$(if $(LAB_ROOT_ARGS),@echo "$(LAB_ROOT_WHY)")
	$(BIN)/jupyter lab --notebook-dir=notebooks $(LAB_ROOT_ARGS) $(LAB_ARGS)

# Debian's packages the tests start for real: chromium for the real-browser tests (never a
# browser download); slurm-wlm + munge and an OpenSSH server for the cluster tests (a real
# slurmctld + slurmd and an sshd on loopback, tests/_clusters.py); jemalloc, the C allocator
# of the processes the tests start (less CPU per compile: tests/conftest.py). One `apt-get
# update` and one install of whatever is missing (apt takes one lock, so one call); needs
# root. On a fresh machine this is minutes of downloads and dpkg (here: chromium's dpkg
# alone 2:15, slurm's 0:29), so `make test` runs it beside pip's and npm's install (`setup`).
# Without Debian's recommended packages: they were 122 of the 155 the install brought
# (avahi-daemon, samba's and CUPS's libraries, upower, udev, SLURM's -dev plugins, HDF5, Perl
# modules), daemons and libraries no test uses, on a user's or a TPU VM's system. The 33
# left start every browser, SLURM, SSH and notebook test (10 s to install from apt's cache).
APT_NEEDS = $(strip \
  $(if $(shell command -v chromium),,chromium) \
  $(if $(shell command -v slurmctld),,slurm-wlm) \
  $(if $(shell command -v munged),,munge) \
  $(if $(or $(shell command -v sshd),$(wildcard /usr/sbin/sshd)),,openssh-server) \
  $(if $(wildcard /usr/lib/*/libjemalloc.so.2),,libjemalloc2))
system-packages:
	@$(if $(APT_NEEDS),echo "installing Debian's $(APT_NEEDS) for the tests"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	    $(APT_NEEDS) >/dev/null,true)
browser clusters: system-packages

# Everything `make test` needs, side by side where they share no files: the Python
# dependencies, the extension's npm packages and Debian's packages (then Workbench itself).
setup:
	@$(MAKE) --no-print-directory -j3 $(STAMP) system-packages

# Every test (CI's and the README's command). pytest exits 5 when a selection (PYTEST_ARGS,
# or test-fast's markers) finds no test: make stops there as on any failure.
# Tests run on TEST_WORKERS pytest-xdist workers (2: this 2-core machine's cores; many tests
# wait on subprocesses, kernels and compiles, so two keep both cores busy). Groups (conftest):
# a module's tests stay together (its fixtures are made once), browser tests share one
# JupyterLab on one worker, each notebook runs alone; the longest groups start first
# (conftest's order: --no-loadscope-reorder keeps it).
# TEST_WORKERS=0 runs everything in this process (for pdb or -s).
TEST_WORKERS ?= 2
XDIST = -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder
# The tests keep the bytecode of what they import (of Workbench and the tests: pytest's
# rewritten test modules) even where the environment sets PYTHONDONTWRITEBYTECODE=1: the
# suite starts hundreds of Python processes, which would each compile Workbench's sources
# again, and pytest would rewrite every test module in every run (~6 s per worker). The
# files land in __pycache__ folders, which git ignores. `make lab` keeps the user's setting.
PYTEST = env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m pytest
test: setup
	$(PYTEST) $(XDIST) --durations=40 $(PYTEST_ARGS)

# The edit-test loop: every test that is not slow, multi-process, a notebook, a browser or
# a TPU compile (pyproject.toml's markers).
FAST_TESTS := not (slow or multiprocess or notebook or browser or tpu)
test-fast: $(STAMP)
	$(PYTEST) $(XDIST) -m "$(FAST_TESTS)" $(PYTEST_ARGS)

# The TPU compiler's plans the tests read back instead of compiling (tests/tpu_plans,
# conftest.TPU_PLANS says why that compares the same): made again from a run of the `tpu`
# tests and notebooks that starts with none, keeping every plan any of them compiled (a
# name already there keeps its file: the same program's plan, so git sees no change).
# Run it after changing what they compile (a model, a rule, a compile flag, jax or libtpu):
# `make test` counts the plans it had to compile live. About 8 minutes here.
tpu-plans: $(STAMP)
	run=$$(mktemp -d) && \
	WORKBENCH_TEST_TPU_PLANS=0 $(PYTEST) $(XDIST) -m tpu -p no:cacheprovider \
	  --basetemp=$$run/pytest $(PYTEST_ARGS) && \
	mkdir -p tests/tpu_plans && find $$run -path '*/plans/*.json.gz' -printf '%f\n' \
	  | sort -u > $$run/names && \
	for f in tests/tpu_plans/*.json.gz; do \
	  grep -qxF "$${f##*/}" $$run/names || rm -f "$$f"; done && \
	find $$run -path '*/plans/*.json.gz' -exec cp -n {} tests/tpu_plans/ \; && \
	echo "tests/tpu_plans: $$(wc -l < $$run/names) plans" && rm -rf $$run

bench: $(STAMP)
	$(BIN)/python -m benchmarks

# The README's screenshots, retaken by the real-browser tests.
README_SHOTS := widgets-mesh-v5p widgets-layout-rank3 widgets-tree exercise-wrong \
	workbench_panel_trained_run workbench_compare_live inline_panel_notebook \
	inline_panel_lab
screenshots: $(STAMP) browser
	$(BIN)/python -m pytest -q tests/test_widgets_browser.py tests/test_lab_browser.py \
	  tests/test_exercises.py
	mkdir -p docs/screenshots
	for s in $(README_SHOTS); do cp artifacts/screenshots/$$s.png docs/screenshots/; done

clean:
	rm -rf $(VENV) build dist labextension/node_modules labextension/lib workbench/labextension
