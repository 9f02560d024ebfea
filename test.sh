#!/usr/bin/env bash
# Sets up and runs the whole test suite (unit, property and multi-process integration tests).
set -euo pipefail
cd "$(dirname "$0")"
./setup.sh
# Two test files at a time (pytest-xdist), each file's tests in one worker so that the servers a
# module starts for its tests stay shared. The suite's tests wait on their servers about half the
# time, so two at a time use both of a small machine's cores. OpenMP threads that wait then sleep
# rather than spin: two workers' spinning threads took each other's cores.
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
exec .venv/bin/python -m pytest -n 2 --dist loadfile "$@"
