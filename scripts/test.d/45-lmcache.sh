#!/usr/bin/env bash
# LMCache 0.5.6's own resp:// remote backend (two ranks, real CacheEngineKeys)
# against a real `kvtier node start` daemon: store, check, load byte-exact.
#
# The venv (PyPI torch used on CPU, vLLM and LMCache) is built once by
# scripts/lib/torch-venv.sh, outside the checkout, and reused.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
export LMCACHE_TRACK_USAGE=false DO_NOT_TRACK=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# One venv with torch, vLLM and LMCache, shared with 60-vllm.sh.
source scripts/lib/torch-venv.sh
VENV=$TORCH_VENV

KVTIER=${KVTIER_BIN:-$ROOT/target/debug/kvtier}
[ -x "$KVTIER" ] || cargo build --locked -q -p kvtier-cli
export KVTIER_BIN=$KVTIER
cd "$ROOT/connector"
# Whole-run limit on top of the per-call limits inside the test.
PYTHONPATH="$ROOT/connector" timeout 300 "$VENV/bin/python" -m pytest -q -p no:cacheprovider \
  --confcutdir "$ROOT/connector/tests/lmcache" "$ROOT/connector/tests/lmcache"
