#!/usr/bin/env bash
# vLLM connector tests (connector/tests/vllm) against a real kvtier daemon.
#
# Installs, idempotently, a cached venv with PyPI torch (CUDA build; it runs on
# CPU) and vLLM 0.33.0 `--no-deps` plus the pure-Python packages its imports
# need (the recipe of reference/vllm-lmcache-api.md §5). The venv is meant to
# be shared with the LMCache tests: the pins below (torch 2.15.0,
# prometheus_client<=0.24.1, opentelemetry-api<=1.40, numpy<=2.2.6,
# protobuf<7) satisfy both vllm 0.33.0 and lmcache 0.5.6.
#
#   MODE=default  all vLLM connector tests (venv set-up: ~5 min and 6.6 GB on a
#                 fresh 2-core machine, once; the tests: ~40 s)
#   MODE=--full   the same plus the slow tests (marked `slow`)
#
# The venv is shared with 45-lmcache.sh: see scripts/lib/torch-venv.sh.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
MODE=${MODE:-default}

source scripts/lib/torch-venv.sh
VENV=$TORCH_VENV

cargo build --locked -q -p kvtier-cli --bin kvtier
export KVTIER_BIN="$ROOT/target/debug/kvtier"
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$ROOT/connector${PYTHONPATH:+:$PYTHONPATH}"
args=(-q -p no:cacheprovider connector/tests/vllm)
[ "$MODE" = "--full" ] || args+=(-m "not slow")
# Bounded: a hang must fail CI, not eat its time budget.
timeout 900 "$VENV/bin/python" -m pytest "${args[@]}"
