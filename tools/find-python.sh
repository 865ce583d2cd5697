#!/bin/sh
# Prints the first Python 3.12+ it finds, for the Makefile's venv: python3 first, then
# python3.12, 3.13, 3.14 on PATH, then pyenv's installed versions (a shim of a version that
# is installed but not selected fails to run, so each candidate is run, not just found).
# JAX 0.11+ and Flax 0.12.12 need Python 3.12 (pyproject.toml). Prints nothing if none runs.
for candidate in python3 python3.12 python3.13 python3.14 \
    "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.1[2-9]*/bin/python3; do
  if "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
    command -v "$candidate" 2>/dev/null || echo "$candidate"
    exit 0
  fi
done
