#!/usr/bin/env bash
# Creates a cluster CA and certificates for a 4-node kvtier cluster with
# `kvtier cert`. Usage:
#   deploy/certs/make-certs.sh OUT_DIR [CLUSTER] [NODE=ADDR ...]
# Defaults: cluster "kvtier", nodes spark1..spark4 without IP SANs.
# Example:
#   deploy/certs/make-certs.sh /tmp/kvtier-certs prod \
#       spark1=10.0.0.1 spark2=10.0.0.2 spark3=10.0.0.3 spark4=10.0.0.4
# Result: OUT_DIR/ca/{ca.pem,ca.key} (keep ca.key offline) and, per node,
# OUT_DIR/NODE/{ca.pem,node.pem,node.key}: copy OUT_DIR/NODE to that node's
# tls-dir (e.g. /etc/kvtier/tls). Key files are 0600. Existing files are
# never overwritten: run again with more nodes to add them (an existing CA
# in OUT_DIR/ca signs them; node directories that exist are left as they
# are). The kvtier binary: $KVTIER_BIN, else kvtier on PATH.
set -euo pipefail
KVTIER=${KVTIER_BIN:-${KVTIER:-kvtier}}
out=${1:?usage: make-certs.sh OUT_DIR [CLUSTER] [NODE=ADDR ...]}
cluster=${2:-kvtier}
cluster_given=$(( $# >= 2 ))
shift $(( $# >= 2 ? 2 : $# ))
nodes=("$@")
if [ ${#nodes[@]} -eq 0 ]; then
  nodes=(spark1 spark2 spark3 spark4)
fi
if [ -e "$out/ca/ca.pem" ] && [ -e "$out/ca/ca.key" ]; then
  # The CA's certificates carry its own cluster id, whatever CLUSTER says:
  # a different one is refused rather than printed as if it were used.
  if [ -f "$out/ca/cluster" ]; then
    ca_cluster=$(cat "$out/ca/cluster")
    if [ "$cluster_given" = 1 ] && [ "$ca_cluster" != "$cluster" ]; then
      echo "make-certs.sh: the CA in $out/ca is of cluster $ca_cluster, not $cluster; use another OUT_DIR for a new cluster" >&2
      exit 1
    fi
    cluster=$ca_cluster
  elif [ "$cluster_given" = 1 ]; then
    echo "warning: the CA in $out/ca records no cluster name; its certificates carry the cluster it was made for, which may not be $cluster" >&2
    cluster="(the CA's)"
  fi
  echo "using the existing CA in $out/ca"
else
  "$KVTIER" cert init-ca --cluster "$cluster" --out "$out/ca"
  echo "$cluster" > "$out/ca/cluster"
fi
for spec in "${nodes[@]}"; do
  name=${spec%%=*}
  if [ -e "$out/$name" ]; then
    echo "$out/$name exists; left as it is"
    continue
  fi
  args=(--ca "$out/ca" --node "$name" --out "$out/$name")
  if [ "$spec" != "$name" ]; then
    args+=(--ip "${spec#*=}")
  fi
  "$KVTIER" cert issue "${args[@]}"
done
echo "cluster $cluster: CA in $out/ca, node directories: ${nodes[*]%%=*}"
