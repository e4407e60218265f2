#!/usr/bin/env bash
# End-to-end checks of real daemons started by the `kvtier` binary:
#   - `kvtier bench crash`: kill -9 torture (10 iterations; 100 with --full):
#     0 wrong reads, 0 phantom chunks, 100 % of flushed chunks survive;
#   - `scripts/cluster-demo`: CA + 4 node certificates, 4 daemons with
#     peers on loopback, two-rank write/restore through the peer cascade,
#     `kvtier peers` on each node, teardown (bounded: 60 s).
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
KVTIER=$ROOT/target/debug/kvtier
[ -x "$KVTIER" ] || cargo build --locked -q -p kvtier-cli

ITER=10
[ "${MODE:-default}" = "--full" ] && ITER=100
echo "kvtier bench crash --iterations $ITER"
timeout 300 "$KVTIER" bench crash --iterations "$ITER"

echo "scripts/cluster-demo"
KVTIER_BIN=$KVTIER CLUSTER_DEMO_TIMEOUT=60 timeout 90 scripts/cluster-demo

echo "deploy/certs/make-certs.sh"
certs=$(mktemp -d)
trap 'rm -rf "$certs"' EXIT
KVTIER_BIN=$KVTIER deploy/certs/make-certs.sh "$certs" prod n1=127.0.0.1 > /dev/null
[ -f "$certs/n1/node.pem" ] && [ "$(cat "$certs/ca/cluster")" = prod ]
# Another cluster name over an existing CA is refused, nothing written.
if KVTIER_BIN=$KVTIER deploy/certs/make-certs.sh "$certs" other n2 2> "$certs/err"; then
  echo "make-certs.sh took a CA of cluster prod for cluster other" >&2
  exit 1
fi
grep -q "of cluster prod, not other" "$certs/err" && [ ! -e "$certs/n2" ]
KVTIER_BIN=$KVTIER deploy/certs/make-certs.sh "$certs" prod n2 | grep -q "^cluster prod:"
echo "make-certs.sh: ok"
