#!/usr/bin/env bash
# Every example config under deploy/config parses and validates with
# `kvtier config check` (run on an empty environment, data dir in a temp dir
# so the free-space check does not depend on this machine's /var/lib), and
# the systemd unit passes `systemd-analyze verify`.
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=${KVTIER_BIN:-target/debug/kvtier}
[ -x "$BIN" ] || cargo build --locked --bin kvtier
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
n=0
# config check loads a cluster node's certificates as the start does: each
# file gets one issued for its node-name (in place of /etc/kvtier/tls).
"$BIN" cert init-ca --cluster examples --out "$tmp/ca" >/dev/null
for f in deploy/config/*.toml; do
  [ -e "$f" ] || continue
  echo "config check $f"
  tls=()
  name=$(sed -n 's/^node-name = "\(.*\)"$/\1/p' "$f")
  if [ -n "$name" ]; then
    [ -d "$tmp/tls-$name" ] || "$BIN" cert issue --ca "$tmp/ca" --node "$name" --out "$tmp/tls-$name" >/dev/null
    tls=(--tls-dir "$tmp/tls-$name")
  fi
  # Keep the file's own values except where they point at system paths.
  env -i PATH="$PATH" HOME="$tmp" "$BIN" config check --config "$f" \
      --data-dir "$tmp/data" --socket "$tmp/kvtier.sock" --disk-budget 0 "${tls[@]}" >"$tmp/out.toml"
  # The printed effective config parses back.
  env -i PATH="$PATH" HOME="$tmp" "$BIN" config check --config "$tmp/out.toml" >/dev/null
  n=$((n + 1))
done
[ "$n" -gt 0 ] || { echo "no configs under deploy/config" >&2; exit 1; }
# A bad key must fail, naming the key and the file.
printf 'ram-budjet = "1GiB"\n' >"$tmp/bad.toml"
if out=$(env -i PATH="$PATH" HOME="$tmp" "$BIN" config check --config "$tmp/bad.toml" 2>&1); then
  echo "config check accepted an unknown key" >&2; exit 1
fi
grep -q 'ram-budjet' <<<"$out" && grep -q 'bad.toml' <<<"$out" || { echo "unclear error: $out" >&2; exit 1; }
echo "$n example config(s) OK"
# The systemd unit is well-formed (when systemd-analyze is installed).
if command -v systemd-analyze >/dev/null 2>&1; then
  bin_abs=$(cd "$(dirname "$BIN")" && pwd)/$(basename "$BIN")
  sed "s#/usr/local/bin/kvtier#$bin_abs#" deploy/systemd/kvtier.service >"$tmp/kvtier.service"
  systemd-analyze verify "$tmp/kvtier.service"
  echo "deploy/systemd/kvtier.service OK"
fi
