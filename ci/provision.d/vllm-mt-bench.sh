#!/usr/bin/env bash
# vLLM 0.32.0's multi-turn benchmark (benchmarks/multi_turn/benchmark_serving_multi_turn.py),
# run unmodified against our router by suites/integration/test_vllm_multi_turn_bench.py.
# The script is not in vLLM's wheel, only in its sdist. pip fetches the sdist and unpacks
# it, then fails to build its metadata (that needs torch and a compiler); with --no-clean
# the unpacked tree stays in our TMPDIR, and we keep the three files the benchmark runs
# from (~85 kB) under <cache>/vllm-mt-bench. Its one package the project's venv lacks,
# pandas, goes into <cache>/vllm-mt-bench/deps (--no-deps: numpy, python-dateutil,
# tzdata, aiohttp, transformers and tqdm come from the venv that runs it). The one vLLM
# helper it imports is stood in for by the test at run time. Later runs: a stamp check.
# Offline it prints why and exits 0 (the test then skips, or fails when the tier is required).
set -euo pipefail
cd "$(dirname "$0")/../.."
VERSION=0.32.0
CACHE=${BIDIR_KV_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/bidir-kv}
DEST=${BIDIR_KV_VLLM_MT_BENCH:-$CACHE/vllm-mt-bench}
[ -f "$DEST/.stamp" ] && exit 0
PY=${PY:-.venv/bin/python}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/pip"
# expected to fail at "preparing metadata"; what counts is the unpacked tree it leaves
TMPDIR="$tmp/pip" "$PY" -m pip download -q "vllm==$VERSION" --no-deps --no-binary vllm \
  --no-build-isolation --no-clean -d "$tmp/dl" >"$tmp/pip.log" 2>&1 || true
src=$(find "$tmp/pip" -path '*/benchmarks/multi_turn/benchmark_serving_multi_turn.py' \
  -print -quit 2>/dev/null || true)
if [ -z "$src" ]; then
  echo "vllm-mt-bench: could not fetch vllm==$VERSION's sdist (offline?); the test will skip" >&2
  tail -3 "$tmp/pip.log" >&2
  exit 0
fi
rm -rf "$DEST.part" && mkdir -p "$DEST.part"
for f in benchmark_serving_multi_turn.py bench_dataset.py bench_utils.py; do
  cp "$(dirname "$src")/$f" "$DEST.part/$f"
done
if ! "$PY" -m pip install -q --no-deps --target "$DEST.part/deps" pandas >"$tmp/pip.log" 2>&1; then
  echo "vllm-mt-bench: could not install pandas (offline?); the test will skip" >&2
  tail -3 "$tmp/pip.log" >&2
  rm -rf "$DEST.part"
  exit 0
fi
echo "vllm==$VERSION benchmarks/multi_turn" > "$DEST.part/.stamp"
rm -rf "$DEST" && mv "$DEST.part" "$DEST"
echo "vllm-mt-bench: $DEST"
