#!/usr/bin/env bash
# Installs Prometheus (the `prometheus` server and `promtool`) from the distribution's package when missing:
# tests/deploy/test_deploy.py and tests/deploy/test_prometheus.py need them (they skip without them). Debian/Ubuntu (apt-get)
# only; as root, or through passwordless sudo. Never fails: when it cannot install, it says why and exits 0.
#
#   bash deploy/install_prometheus.sh
set -u

if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; then
    echo "prometheus already installed: $(prometheus --version 2>&1 | head -n1)"
    exit 0
fi

skip() {
    echo "install_prometheus.sh: cannot install Prometheus: $*" >&2
    echo "install_prometheus.sh: the tests that need prometheus/promtool will be skipped." >&2
    exit 0
}

command -v apt-get >/dev/null 2>&1 || skip "no apt-get (install the prometheus package, or put the prometheus and promtool binaries on PATH)"
if [ "$(id -u)" -eq 0 ]; then
    SUDO=()
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    SUDO=(sudo -n)
else
    skip "not root and no passwordless sudo"
fi

apt_install() {
    "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends prometheus
}

echo "installing the Debian package prometheus (prometheus + promtool)..."
# Try the package lists as they are first; refresh them only when that fails.
if ! apt_install; then
    "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -q || skip "apt-get update failed"
    apt_install || skip "apt-get install prometheus failed"
fi

if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; then
    echo "installed: $(prometheus --version 2>&1 | head -n1)"
else
    skip "the package installed but prometheus/promtool are not on PATH"
fi
# Note: on a host booted with systemd the package also enables a prometheus.service on :9090; the tests do
# not use it (they start their own on a free loopback port).
