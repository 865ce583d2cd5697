# Workbench: two commands set everything up on a fresh machine.
#   make lab    create .venv, install workbench (+ lab extension), open JupyterLab on notebooks/
#   make test   create/refresh .venv when needed, install test tools, run every test
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Where no accelerator exists, JAX gets 8 simulated CPU devices (harmless on GPU/TPU).
export XLA_FLAGS ?= --xla_force_host_platform_device_count=8
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: lab test bench browser install clean screenshots

$(STAMP): pyproject.toml $(wildcard labextension/package.json labextension/src/*.ts labextension/style/* labextension/schema/*)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

lab: $(STAMP)
	$(BIN)/jupyter lab --notebook-dir=notebooks $(LAB_ARGS)

# Debian's chromium for the real-browser tests (never a browser download).
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  echo "installing Debian's chromium for browser tests"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }

test: $(STAMP) browser
	$(BIN)/python -m pytest $(PYTEST_ARGS)

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
