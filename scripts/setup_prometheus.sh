#!/usr/bin/env bash
# Installs Prometheus (`prometheus` and `promtool`) from Debian's package, for the tests in
# tests/deploy (promtool checks of deploy/prometheus, and a real Prometheus scraping kvgate).
# Idempotent: returns at once when both binaries are already on PATH. Needs root (or sudo).
# The package's own service is never left running: this script stops it if it was started.
set -euo pipefail

if command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1; then
  exit 0
fi

SUDO=()
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then
    SUDO=(sudo)
  else
    echo "setup_prometheus.sh: promtool is missing and installing it needs root" >&2
    exit 1
  fi
fi

install_pkg() {
  "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive \
    apt-get install -y --no-install-recommends prometheus
}

echo "== installing Debian's prometheus package (prometheus, promtool)"
if ! install_pkg; then
  "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update
  install_pkg
fi

# The package may start its daemon (0.0.0.0:9090) where an init system or policy allows it;
# stop it through the init script so no system Prometheus is left behind.
if command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
  "${SUDO[@]}" systemctl disable --now prometheus >/dev/null 2>&1 || true
elif [ -x /etc/init.d/prometheus ]; then
  "${SUDO[@]}" /etc/init.d/prometheus stop >/dev/null 2>&1 || true
fi

promtool --version 2>&1 | sed -n 1p
