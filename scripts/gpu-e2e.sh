#!/usr/bin/env bash
# GPU end-to-end check of the vLLM connector's worker path (see scripts/gpu-e2e.py).
#
# On the build machine:   cargo build --release -p kvtier-cli
# On the GPU machine:     scripts/gpu-e2e.sh [extra gpu-e2e.py flags]
#   (carry target/release/kvtier with the working tree; needs python3 + torch, not vLLM)
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${KVTIER_BIN:-target/release/kvtier}
[ -x "$BIN" ] || { echo "no kvtier binary at $BIN (cargo build --release -p kvtier-cli)" >&2; exit 1; }
PY=${PYTHON:-python3}
exec "$PY" scripts/gpu-e2e.py --kvtier "$BIN" "$@"
