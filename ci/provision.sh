#!/usr/bin/env bash
# Provision what the test tiers need on this machine. Each step is idempotent and cached.
set -euo pipefail
cd "$(dirname "$0")/.."
for step in ci/provision.d/*.sh; do
  [ -e "$step" ] || continue
  echo "== provision: $step"
  bash "$step"
done
