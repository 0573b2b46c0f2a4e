#!/usr/bin/env bash
# Set up a virtual environment from the project's files: the core, its command-line extras and
# the first-party CPU backend (Numba), so `.venv/bin/softmaxkit` runs on the default CPU path.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -e ".[bench]"
if [ -f backends/numba-cpu/pyproject.toml ]; then
    .venv/bin/python -m pip install --quiet -e backends/numba-cpu
fi
