#!/usr/bin/env bash
# Redis for the router's shared-store tests (bidir_kv/topology/redis_server.py starts its
# own redis-server on a free loopback port; nothing here starts a server). Idempotent.
set -euo pipefail
if command -v redis-server >/dev/null 2>&1; then
  echo "redis-server present: $(redis-server --version | head -1)"
  exit 0
fi
if [ "$(id -u)" -ne 0 ] && ! command -v sudo >/dev/null 2>&1; then
  echo "redis-server missing and not root: install Debian's redis-server package" >&2
  exit 1
fi
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get -o DPkg::Lock::Timeout=300 update -qq
$SUDO apt-get -o DPkg::Lock::Timeout=300 install -y -qq --no-install-recommends redis-server >/dev/null
# The package may start a system service; our tests never use it.
command -v redis-server >/dev/null
echo "redis-server installed: $(redis-server --version | head -1)"
