#!/usr/bin/env bash
# LMCache 0.5.6's own resp:// remote backend (two ranks, real CacheEngineKeys)
# against a real `kvtier node start` daemon: store, check, load byte-exact.
#
# The LMCache venv (CPU-only use of PyPI torch, about 6 GB and 100 s once) is
# cached in $ROOT/.cache/venv-lmcache and reused when its marker is present.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
VENV=$ROOT/.cache/venv-lmcache
MARKER=$VENV/.kvtier-lmcache-0.5.6-ok
export LMCACHE_TRACK_USAGE=false DO_NOT_TRACK=1 PIP_DISABLE_PIP_VERSION_CHECK=1

if [ ! -f "$MARKER" ]; then
  echo "45-lmcache: installing LMCache 0.5.6 into $VENV (once)"
  [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q torch
  "$VENV/bin/pip" install -q --no-deps lmcache==0.5.6
  # Its requirements, less extras and the CUDA-only ones (and torch, installed above).
  mapfile -t REQS < <("$VENV/bin/python" - <<'PY'
import importlib.metadata as m, re
skip = {"torch", "cupy-cuda13x", "cuda-python", "cufile-python"}
for r in m.requires("lmcache") or []:
    if "extra ==" in r:
        continue
    name = re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0].strip().lower()
    if name in skip:
        continue
    print(r.split(";")[0].replace(" ", ""))
PY
)
  "$VENV/bin/pip" install -q "${REQS[@]}"
  "$VENV/bin/python" -c 'import lmcache.lmcache_redis, lmcache.v1.storage_backend' \
    || { echo "45-lmcache: LMCache does not import" >&2; exit 1; }
  touch "$MARKER"
fi

KVTIER=${KVTIER_BIN:-$ROOT/target/debug/kvtier}
[ -x "$KVTIER" ] || cargo build --locked -q -p kvtier-cli
export KVTIER_BIN=$KVTIER
cd "$ROOT/connector"
# Whole-run limit on top of the per-call limits inside the test.
PYTHONPATH="$ROOT/connector" timeout 300 "$VENV/bin/python" -m pytest -q -p no:cacheprovider \
  --confcutdir "$ROOT/connector/tests/lmcache" "$ROOT/connector/tests/lmcache"
