#!/usr/bin/env bash
# Python client tests (connector/): golden frames shared with the Rust codec,
# and round trips against a real daemon (target/debug/kvtier, built by
# scripts/test before this hook runs).
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
VENV="${KVTEST_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvtier-test}/venv-py"
mkdir -p "$(dirname "$VENV")"

if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
# Idempotent: pip skips what is installed; the stamp avoids even that.
# redis: redis-py, a RESP client the endpoint must serve (tests/test_resp.py).
# google-crc32c: the client's optional C CRC32C (the `fast` extra); the
# pure-Python CRC is checked against it in tests/test_client.py.
DEPS="pytest numpy redis google-crc32c"
STAMP="$VENV/.kvtier-deps-$( (cat connector/pyproject.toml; echo "$DEPS") | sha256sum | cut -c1-16)"
if [ ! -e "$STAMP" ]; then
  # shellcheck disable=SC2086
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check $DEPS
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -e connector
  touch "$STAMP"
fi

if [ ! -x "$ROOT/target/debug/kvtier" ]; then
  cargo build --locked -p kvtier-cli
fi

# The daemon is required here: a missing or failing binary fails the run.
export REQUIRE_KVTIER_DAEMON=1
set +e
(cd connector && "$VENV/bin/python" -m pytest -q tests/test_client.py tests/test_resp.py)
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests" >&2
  exit 1
fi
[ "$rc" -eq 0 ] || exit "$rc"
# The Python client benchmark, small: it keeps working (figures: docs/benchmarks.md).
"$VENV/bin/python" scripts/python-client-bench.py --quick --depth 4 --kvtier "$ROOT/target/debug/kvtier"
