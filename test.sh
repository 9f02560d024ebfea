#!/usr/bin/env bash
# Sets up and runs the whole test suite (unit, property and multi-process integration tests).
set -euo pipefail
cd "$(dirname "$0")"
./setup.sh
exec .venv/bin/python -m pytest "$@"
