#!/usr/bin/env bash
# Installs what benchmarks/bench_throughput.py needs besides the venv: Debian's wrk (the load
# generator) and nginx (a baseline proxy); its HAProxy rows also need scripts/setup_replicas.sh.
set -euo pipefail
missing=()
command -v wrk >/dev/null 2>&1 || missing+=(wrk)
command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || missing+=(nginx)
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "setup_bench: ${missing[*]} missing and apt-get is not available" >&2
  exit 1
fi
SUDO=""
if [ "$(id -u)" != "0" ]; then SUDO="sudo"; fi
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
# the package may start its own service: the benchmark starts its own nginx
$SUDO service nginx stop >/dev/null 2>&1 || true
