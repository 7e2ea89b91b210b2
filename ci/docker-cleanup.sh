#!/usr/bin/env bash
# Remove what the container backend left behind (docs/containers.md §2.4, §4.3, §7).
#
#   ci/docker-cleanup.sh            containers labelled org.testcontainers.lang=python and
#                                   the Docker networks our topologies created
#                                   (label org.bidir-kv.topology)
#   ci/docker-cleanup.sh --daemon   also stop the dockerd that ci/provision.d/docker.sh
#                                   started (by its recorded PID) and undo the host state that
#                                   daemon leaves: DOCKER* chains and their jump rules,
#                                   docker0/br-* FORWARD and MASQUERADE rules, the FORWARD
#                                   policy, docker0, and net.ipv4.ip_forward.
#
# Only what we created: nothing happens to a daemon we did not start, and host rules are
# only touched after stopping our own daemon. Never fails on "nothing to clean".
set -uo pipefail
cd "$(dirname "$0")/.."
CACHE=.cache
PIDFILE=$CACHE/dockerd.pid

if docker info >/dev/null 2>&1; then
  ids=$(docker ps -aq --filter label=org.testcontainers.lang=python)
  if [ -n "$ids" ]; then
    echo "docker-cleanup: removing containers: $(echo "$ids" | tr '\n' ' ')"
    # shellcheck disable=SC2086
    docker rm -f $ids >/dev/null
  fi
  nets=$(docker network ls -q --filter label=org.bidir-kv.topology)
  if [ -n "$nets" ]; then
    echo "docker-cleanup: removing networks: $(echo "$nets" | tr '\n' ' ')"
    # shellcheck disable=SC2086
    docker network rm $nets >/dev/null
  fi
fi

[ "${1:-}" = "--daemon" ] || exit 0

if [ ! -f "$PIDFILE" ]; then
  echo "docker-cleanup: no $PIDFILE - we did not start a dockerd; leaving the host alone"
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "docker-cleanup: not root - cannot stop dockerd or undo its host rules" >&2
  exit 0
fi
pid=$(cat "$PIDFILE")
if kill -0 "$pid" 2>/dev/null && [ "$(cat /proc/"$pid"/comm 2>/dev/null)" = "dockerd" ]; then
  kill -TERM "$pid"
  for _ in $(seq 1 200); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "$pid" 2>/dev/null; then
    echo "docker-cleanup: dockerd $pid ignored SIGTERM for 20 s; sending SIGKILL" >&2
    kill -KILL "$pid"
  fi
  echo "docker-cleanup: stopped dockerd (pid $pid)"
else
  echo "docker-cleanup: dockerd $pid from $PIDFILE is not running"
fi
rm -f "$PIDFILE"

if command -v iptables >/dev/null 2>&1; then
  bridge='(docker0|br-[0-9a-f]{12})'
  # jump rules into DOCKER* chains and per-bridge rules, then the chains themselves
  for table in filter nat; do
    iptables -t "$table" -S 2>/dev/null |
      grep -E "^-A (FORWARD|PREROUTING|OUTPUT|POSTROUTING) .*(-j DOCKER|$bridge)" |
      sed 's/^-A /-D /' |
      while read -r rule; do
        # shellcheck disable=SC2086
        iptables -t "$table" $rule || echo "docker-cleanup: could not delete: $rule" >&2
      done
    for chain in $(iptables -t "$table" -S 2>/dev/null | awk '$1 == "-N" && $2 ~ /^DOCKER/ {print $2}'); do
      iptables -t "$table" -F "$chain"
    done
    for chain in $(iptables -t "$table" -S 2>/dev/null | awk '$1 == "-N" && $2 ~ /^DOCKER/ {print $2}'); do
      iptables -t "$table" -X "$chain" || echo "docker-cleanup: could not delete chain $chain" >&2
    done
  done
  policy=$(cat "$CACHE/dockerd.forward_policy" 2>/dev/null)
  if [ -n "$policy" ]; then
    iptables -P FORWARD "$policy"
  fi
fi
if [ "$(cat "$CACHE/dockerd.had_docker0" 2>/dev/null)" = "no" ] && ip link show docker0 >/dev/null 2>&1; then
  ip link del docker0
fi
for link in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | grep -E '^br-[0-9a-f]{12}$'); do
  ip link del "$link"
done
if [ -f "$CACHE/dockerd.ip_forward" ]; then
  sysctl -q -w net.ipv4.ip_forward="$(cat "$CACHE/dockerd.ip_forward")"
fi
rm -f "$CACHE/dockerd.ip_forward" "$CACHE/dockerd.forward_policy" "$CACHE/dockerd.had_docker0"
echo "docker-cleanup: host rules, docker0 and ip_forward restored"
