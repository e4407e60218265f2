#!/usr/bin/env bash
# The tier's `fail` failpoint scenarios (feature `failpoints`, own target).
set -euo pipefail
cd "$(dirname "$0")/../.."
if command -v cargo-nextest >/dev/null 2>&1; then
  cargo nextest run --locked -p kvtier-tier --features failpoints --test failpoints
else
  cargo test --locked -p kvtier-tier --features failpoints --test failpoints
fi
