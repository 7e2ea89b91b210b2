#!/usr/bin/env bash
# Run pytest from the project venv. Exit code 5 ("no tests collected") is a failure here,
# never a silent success.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
mkdir -p out
"$PY" -m pytest "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "ci/pytest.sh: pytest collected no tests (exit 5) - treating as failure" >&2
  exit 1
fi
exit "$rc"
