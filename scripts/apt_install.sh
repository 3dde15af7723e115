#!/usr/bin/env bash
# Installs Debian packages with apt-get (as root, or through sudo) and stops any service a
# package started: the tests and benchmarks start their own servers.
# Usage: scripts/apt_install.sh PKG [PKG ...]   (used by setup_replicas.sh and setup_bench.sh)
set -euo pipefail
if ! command -v apt-get >/dev/null 2>&1; then
  echo "apt_install: $* missing and apt-get is not available; install them" >&2
  exit 1
fi
SUDO=""
if [ "$(id -u)" != "0" ]; then SUDO="sudo"; fi
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "$@" >/dev/null
for pkg in "$@"; do
  $SUDO service "$pkg" stop >/dev/null 2>&1 || true
done
