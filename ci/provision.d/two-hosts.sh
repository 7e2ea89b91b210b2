#!/usr/bin/env bash
# Two hosts on this machine for the ssh launcher's tests and the dry run
# (bidir_kv/testing/netns.py): iproute2 for the network namespace and veth pair,
# OpenSSH's server and client. The fixture starts its own sshd (own config, host key,
# authorized key, listening only on D's namespace address); nothing here starts one.
# Idempotent; needs root.
set -euo pipefail
missing=()
command -v ip >/dev/null 2>&1 || missing+=(iproute2)
[ -x /usr/sbin/sshd ] || missing+=(openssh-server)
command -v ssh >/dev/null 2>&1 || missing+=(openssh-client)
if [ "${#missing[@]}" -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "two hosts need root; missing: ${missing[*]}" >&2
    exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get -o DPkg::Lock::Timeout=300 update -qq
  apt-get -o DPkg::Lock::Timeout=300 install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
# sshd's privilege separation directory (the package's service unit makes it at start)
[ "$(id -u)" -ne 0 ] || install -d -m 0755 /run/sshd
echo "two hosts: $(ip -V), $(/usr/sbin/sshd -V 2>&1 | head -1 || true)"
