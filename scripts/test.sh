#!/usr/bin/env bash
# The test command of the README and of CI: installs what it needs, then runs the whole suite on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest tests "$@"
