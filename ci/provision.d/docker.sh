#!/usr/bin/env bash
# Docker engine for the container backend of the integration tier (docs/containers.md §2).
#
# As root: install Debian's docker.io + iptables when missing, start `dockerd` in the
# background when no engine answers, record its PID (and the host state it changes) under
# .cache/ so ci/docker-cleanup.sh can stop exactly this daemon and undo exactly its rules.
# Not root: print why and exit 0 (the container tests then skip, naming the reason).
# Idempotent: a running engine is reused as is.
set -euo pipefail
cd "$(dirname "$0")/../.."
CACHE=.cache
PIDFILE=$CACHE/dockerd.pid
LOG=$CACHE/dockerd.log
mkdir -p "$CACHE"
elapsed() { awk -v a="$1" -v b="$(date +%s.%N)" 'BEGIN { printf "%.2f", b - a }'; }

if docker info >/dev/null 2>&1; then
  echo "docker: engine already running ($(docker version -f '{{.Server.Version}}' 2>/dev/null))"
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "docker: not root - cannot install or start dockerd here; container tests will skip" \
       "(start a Docker engine yourself, or run this script as root)"
  exit 0
fi

t0=$(date +%s.%N)
if ! command -v dockerd >/dev/null 2>&1 || ! command -v iptables >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get -o DPkg::Lock::Timeout=300 update -qq
  # the post-install script prints "policy-rc.d denied execution of start": no init system
  apt-get -o DPkg::Lock::Timeout=300 install -y -qq --no-install-recommends docker.io iptables >/dev/null
  echo "docker: installed docker.io + iptables in $(elapsed "$t0") s"
fi

# Host state dockerd changes and leaves behind (docs/containers.md §2.4); recorded once, before
# the first start, so cleanup restores the original values and not the daemon's.
[ -f "$CACHE/dockerd.ip_forward" ] || sysctl -n net.ipv4.ip_forward >"$CACHE/dockerd.ip_forward"
[ -f "$CACHE/dockerd.forward_policy" ] ||
  iptables -S FORWARD 2>/dev/null | awk '$1 == "-P" {print $3}' >"$CACHE/dockerd.forward_policy"
[ -f "$CACHE/dockerd.had_docker0" ] ||
  { ip link show docker0 >/dev/null 2>&1 && echo yes || echo no; } >"$CACHE/dockerd.had_docker0"

t1=$(date +%s.%N)
# own session: a Ctrl-C on `make test` must not take the daemon down mid-run
setsid dockerd >"$LOG" 2>&1 </dev/null &
pid=$!
echo "$pid" >"$PIDFILE"
for _ in $(seq 1 300); do
  if docker info >/dev/null 2>&1; then
    echo "docker: dockerd (pid $pid) ready in $(elapsed "$t1") s," \
         "server $(docker version -f '{{.Server.Version}}'); log $LOG"
    exit 0
  fi
  if ! kill -0 "$pid" 2>/dev/null; then
    echo "docker: dockerd exited during startup; last log lines:" >&2
    tail -n 30 "$LOG" >&2
    rm -f "$PIDFILE"
    exit 1
  fi
  sleep 0.1
done
echo "docker: dockerd (pid $pid) not ready after 30 s; last log lines:" >&2
tail -n 30 "$LOG" >&2
exit 1
