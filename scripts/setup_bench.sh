#!/usr/bin/env bash
# Installs what benchmarks/speed/throughput.py needs besides the venv: Debian's wrk (the load
# generator) and nginx (a baseline proxy); its HAProxy rows also need scripts/setup_replicas.sh.
set -euo pipefail
missing=()
command -v wrk >/dev/null 2>&1 || missing+=(wrk)
command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || missing+=(nginx)
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
"$(dirname "$0")/apt_install.sh" "${missing[@]}"
