#!/usr/bin/env bash
# Installs the project into .venv (created if missing). Idempotent: a second run installs nothing new.
# torch is pinned in pyproject.toml to the CPU build that lies on local disk; never let pip pick another.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install --quiet --disable-pip-version-check --upgrade pip 2>/dev/null || true
.venv/bin/python -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[test]"
echo "installed into $(pwd)/.venv"
