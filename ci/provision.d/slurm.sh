#!/usr/bin/env bash
# Slurm for the slurm launcher's tier (suites/integration/test_slurm.py): Debian's
# slurmctld, slurmd, the client commands (salloc, srun, squeue, scancel, scontrol) and
# MUNGE. The fixture (bidir_kv/testing/slurm.py) starts its own munged, slurmctld and two
# slurmd with their own configuration, key, spool, state and ports; nothing here starts
# or enables a daemon (the packages' services are stopped and disabled where a service
# manager runs them). Idempotent; needs root.
set -euo pipefail
missing=()
for tool in slurmctld slurmd srun munged; do
  command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
done
if [ "${#missing[@]}" -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "slurm: installing needs root; missing: ${missing[*]}" >&2
    exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get -o DPkg::Lock::Timeout=300 update -qq
  apt-get -o DPkg::Lock::Timeout=300 install -y -qq --no-install-recommends \
    slurmctld slurmd slurm-client munge >/dev/null
fi
# the packages may start their own daemons (with the system's config and key): stop them,
# the fixture's daemons must be the only ones
for svc in slurmctld slurmd munge; do
  if command -v systemctl >/dev/null 2>&1 && systemctl is-system-running >/dev/null 2>&1; then
    systemctl disable --now "$svc" >/dev/null 2>&1 || true
  fi
done
echo "slurm: $(slurmctld -V), $(munged --version 2>&1 | head -1)"
