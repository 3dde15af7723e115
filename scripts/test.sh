#!/usr/bin/env bash
# kvgate's test command: sets up .venv if needed, then lint, type-check and the fast test suite.
# Usage: ./scripts/test.sh [extra pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[dev,plots]'
echo "== ruff"
.venv/bin/ruff check gateway tests benchmarks
.venv/bin/ruff format --check gateway tests benchmarks
echo "== mypy --strict"
.venv/bin/mypy
echo "== pytest (fast suite)"
.venv/bin/python -m pytest -m "not vllm" "$@"
