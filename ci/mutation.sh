#!/usr/bin/env bash
# Mutation testing (`make mutation`, the nightly job; never `make test`: it is slow).
#   ci/mutation.sh [SCOPE...]   SCOPE: a dotted package or module of [tool.mutmut]
#                               only_mutate (default: $MUTATION_SCOPES, else every one)
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
# every file of [tool.mutmut] only_mutate, as a scope of its own (policy/ is one)
ALL_SCOPES="bidir_kv.policy bidir_kv.protocol bidir_kv.router.identity bidir_kv.router.guard \
bidir_kv.router.store.memory bidir_kv.router.relay bidir_kv.connector.rules bidir_kv.plan.planner"
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
# shellcheck disable=SC2086  # MUTATION_PACKAGE_FLOORS is a list of --package-floor X=Y
exec "$PY" -m bidir_kv.tools.mutation_score "${scope_args[@]}" --floor "$FLOOR" \
  ${MUTATION_PACKAGE_FLOORS:-} --equivalents ci/mutation-equivalents.txt \
  --out out/mutation --mutmut "$MUTMUT"
