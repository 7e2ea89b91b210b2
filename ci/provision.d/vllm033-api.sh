#!/usr/bin/env bash
# vLLM 0.33.0's connector-facing source, for the static API check of bidir_kv.connector
# (suites/conformance/test_connector_api.py, docs/connector.md). Downloads the wheel once
# (pip download --no-deps, ~340 MB, a few seconds), keeps only the files the check reads
# (~0.5 MB) under <cache>/vllm-0.33.0-src and deletes the wheel; later runs: a stamp check.
# Offline it prints why and exits 0 (the test then skips, or fails when the tier is required).
set -euo pipefail
cd "$(dirname "$0")/../.."
VERSION=0.33.0
CACHE=${BIDIR_KV_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/bidir-kv}
DEST=${BIDIR_KV_VLLM033_SRC:-$CACHE/vllm-$VERSION-src}
[ -f "$DEST/.stamp" ] && exit 0
PY=${PY:-.venv/bin/python}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
if ! "$PY" -m pip download -q "vllm==$VERSION" --no-deps -d "$tmp" >"$tmp/pip.log" 2>&1; then
  echo "vllm033-api: could not download vllm==$VERSION (offline?); the API check will skip" >&2
  tail -3 "$tmp/pip.log" >&2
  exit 0
fi
rm -rf "$DEST.part" && mkdir -p "$DEST.part"
"$PY" - "$tmp"/vllm-"$VERSION"-*.whl "$DEST.part" <<'PYEOF'
import sys, zipfile
wheel, dest = sys.argv[1], sys.argv[2]
keep = ("vllm/distributed/kv_transfer/kv_connector/", "vllm/_version.py", "vllm/config/kv_transfer.py")
with zipfile.ZipFile(wheel) as z:
    z.extractall(dest, [n for n in z.namelist() if n.startswith(keep) and n.endswith(".py")])
PYEOF
echo "vllm==$VERSION" > "$DEST.part/.stamp"
rm -rf "$DEST" && mv "$DEST.part" "$DEST"
echo "vllm033-api: $DEST"
