#!/usr/bin/env bash
# Installs what the C and JavaScript clients and their tests need, skipping what is already there (a second
# run takes about a second): a C compiler, make, pkg-config, libzmq and msgpack-c headers, systemd-analyze
# (tests/test_systemd_unit.py), Node.js with npm, and clients/js/node_modules from package-lock.json.
# Debian or Ubuntu; runs apt-get as root, through sudo otherwise.
set -euo pipefail
cd "$(dirname "$0")"

missing=()
command -v cc >/dev/null || missing+=(gcc libc6-dev)
command -v make >/dev/null || missing+=(make)
command -v pkg-config >/dev/null || missing+=(pkg-config)
pkg-config --exists libzmq 2>/dev/null || missing+=(libzmq3-dev)
pkg-config --exists msgpack-c 2>/dev/null || pkg-config --exists msgpack 2>/dev/null || missing+=(msgpack)
command -v systemd-analyze >/dev/null || missing+=(systemd)
{ command -v node && command -v npm; } >/dev/null || missing+=(nodejs npm)

if ((${#missing[@]})); then
  sudo=""
  [[ $(id -u) -eq 0 ]] || sudo="sudo"
  $sudo apt-get update -q
  packages=()
  for name in "${missing[@]}"; do
    if [[ $name == msgpack ]]; then
      # msgpack-c's C library: libmsgpack-c-dev since Debian trixie, libmsgpack-dev (C and C++) before.
      if apt-cache show libmsgpack-c-dev >/dev/null 2>&1; then name=libmsgpack-c-dev; else name=libmsgpack-dev; fi
    fi
    packages+=("$name")
  done
  echo "install-deps: installing ${packages[*]}"
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${packages[@]}"
fi

# npm ci when node_modules is missing or older than the lock file (npm writes node_modules/.package-lock.json).
if [[ ! js/node_modules/.package-lock.json -nt js/package-lock.json ]]; then
  (cd js && npm ci --no-audit --no-fund)
fi
