#!/usr/bin/env bash
# Run pytest from the project venv.
#   ci/pytest.sh ARGS...   one pytest run with ARGS (`make unit` passes -n for xdist)
#   ci/pytest.sh           the whole pre-merge suite (-m pre_merge: every test not marked
#                          nightly, docs/testing.md) in two runs (`make test`):
#     1. unit + integration on $BIDIR_KV_WORKERS xdist workers (default 2; one module's
#        tests stay on one worker, so a module's shared topology starts once);
#     2. conformance + hardware serially: real vLLM pairs are pinned to the cores
#        (VllmCpuOptions.pin_servers) and must not share them with a second worker.
#     Each run writes its per-test times to out/junit-{parallel,serial}.xml.
# - Exit code 5 ("no tests collected") is a failure here, never a silent success; in
#   the two-run form each run's exit code counts.
# - Under CI=true the tiers this machine can run are required: missing infrastructure
#   fails instead of skipping (BIDIR_KV_REQUIRE; see bidir_kv/testing/gating.py).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
WORKERS=${BIDIR_KV_WORKERS:-2}
mkdir -p out
if [ "${CI:-}" = "true" ] && [ -z "${BIDIR_KV_REQUIRE+x}" ]; then
  export BIDIR_KV_REQUIRE="unit,integration,conformance,hardware"
fi

run_pytest() {
  "$PY" -m pytest --durations=15 "$@"
  local rc=$?
  if [ "$rc" -eq 5 ]; then
    echo "ci/pytest.sh: pytest collected no tests (exit 5) - treating as failure" >&2
    return 1
  fi
  return "$rc"
}

if [ "$#" -gt 0 ]; then
  run_pytest "$@"
  exit $?
fi

run_pytest -n "$WORKERS" --dist loadscope -m pre_merge --junitxml=out/junit-parallel.xml \
  suites/unit suites/integration
rc_parallel=$?
run_pytest -m pre_merge --junitxml=out/junit-serial.xml suites/conformance suites/hardware
rc_serial=$?
echo "ci/pytest.sh: unit+integration (xdist, $WORKERS workers) exit $rc_parallel;" \
     "conformance+hardware (serial) exit $rc_serial" >&2
if [ "$rc_parallel" -ne 0 ]; then exit "$rc_parallel"; fi
exit "$rc_serial"
