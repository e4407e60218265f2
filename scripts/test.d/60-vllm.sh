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
# Env: KVTIER_TORCH_VENV overrides the venv path (default .cache/venv-torch).
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
MODE=${MODE:-default}
VENV=${KVTIER_TORCH_VENV:-$ROOT/.cache/venv-torch}

# Bump STAMP whenever the package list changes: the venv is then updated.
PKGS_TORCH="torch==2.15.0"
PKGS_VLLM="vllm==0.33.0"
PKGS_DEPS=(
  "numpy<=2.2.6" "protobuf>=6.33.5,<7" "prometheus_client>=0.18,<=0.24.1"
  "opentelemetry-api>=1.27,<=1.40.0" "transformers>=5.16.1,<5.21.0"
  "huggingface_hub>=1.31.0" "tokenizers>=0.23.2" "safetensors>=0.6.2"
  regex cachetools psutil requests tqdm blake3 py-cpuinfo pydantic msgspec pyzmq
  pyyaml cbor2 cloudpickle aiohttp openai openai-harmony pillow pybase64 uvloop
  "xgrammar==0.2.8" "llguidance>=1.7.0,<1.8.0" "fastapi<0.137.0,>=0.133.0"
  partial-json-parser einops sentencepiece "lark==1.2.2" "outlines_core==0.2.14"
  watchfiles python-json-logger setproctitle ijson pytest
)
STAMP="v1 $PKGS_TORCH $PKGS_VLLM ${PKGS_DEPS[*]}"

if [ ! -x "$VENV/bin/python" ] || [ "$(cat "$VENV/.kvtier-vllm-stamp" 2>/dev/null)" != "$STAMP" ]; then
  echo "setting up $VENV (torch, vllm --no-deps, import deps)"
  [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
  log=$(mktemp)
  # vllm is installed without its (CUDA) dependencies, so pip's resolver
  # complains about them: keep its output unless a step fails.
  if ! { "$VENV/bin/pip" install -q "$PKGS_TORCH" &&
         "$VENV/bin/pip" install -q --no-deps "$PKGS_VLLM" &&
         "$VENV/bin/pip" install -q "${PKGS_DEPS[@]}" "$PKGS_TORCH"; } >"$log" 2>&1; then
    cat "$log"
    exit 1
  fi
  rm -f "$log"
  echo "$STAMP" > "$VENV/.kvtier-vllm-stamp"
fi

cargo build --locked -q -p kvtier-cli --bin kvtier
export KVTIER_BIN="$ROOT/target/debug/kvtier"
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$ROOT/connector${PYTHONPATH:+:$PYTHONPATH}"
args=(-q -p no:cacheprovider connector/tests/vllm)
[ "$MODE" = "--full" ] || args+=(-m "not slow")
# Bounded: a hang must fail CI, not eat its time budget.
timeout 900 "$VENV/bin/python" -m pytest "${args[@]}"
