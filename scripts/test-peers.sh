#!/usr/bin/env bash
# Real peers the tests talk to that pip cannot install: promtool (Prometheus) and systemd-analyze.
# Installed from Debian's packages when missing and we are root; otherwise say what is missing.
set -euo pipefail
need=()
command -v promtool >/dev/null || need+=(prometheus)
command -v systemd-analyze >/dev/null || need+=(systemd)
[ ${#need[@]} -eq 0 ] && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
else
  echo "tests need: ${need[*]} (Debian packages); install them, e.g. sudo apt-get install ${need[*]}" >&2
  exit 1
fi
