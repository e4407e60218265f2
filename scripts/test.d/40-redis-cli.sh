#!/usr/bin/env bash
# redis-cli and redis-benchmark (Debian redis-tools) against a real
# `kvtier node start` daemon's RESP endpoint, plus curl on its HTTP endpoint.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD

# shellcheck source=../lib/apt.sh
. scripts/lib/apt.sh
need_apt redis-cli:redis-tools redis-benchmark:redis-tools curl:curl

KVTIER=${KVTIER_BIN:-$ROOT/target/debug/kvtier}
[ -x "$KVTIER" ] || cargo build --locked -q -p kvtier-cli
TMP=$(mktemp -d)
PID=
cleanup() {
  if [ -n "$PID" ] && kill -0 "$PID" 2>/dev/null; then
    kill -TERM "$PID" 2>/dev/null || true
    for _ in $(seq 1 100); do kill -0 "$PID" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$PID" 2>/dev/null || true
  fi
  rm -rf "$TMP"
}
trap cleanup EXIT
fail() { echo "40-redis-cli: FAIL: $*" >&2; [ -f "$TMP/node.log" ] && tail -n 30 "$TMP/node.log" >&2; exit 1; }

env -u KVTIER_BIN "$KVTIER" node start --data-dir "$TMP/data" --socket "$TMP/s.sock" --ram-budget 1GiB --disk-budget 0 \
  --resp-listen 127.0.0.1:0 --http-listen 127.0.0.1:0 >"$TMP/node.log" 2>&1 &
PID=$!
PORT= ; HTTP=
for _ in $(seq 1 300); do
  PORT=$(sed -n 's/.*resp  *127\.0\.0\.1:\([0-9][0-9]*\).*/\1/p' "$TMP/node.log" | head -n1)
  HTTP=$(sed -n 's#.*http://\(127\.0\.0\.1:[0-9][0-9]*\)/metrics.*#\1#p' "$TMP/node.log" | head -n1)
  [ -n "$PORT" ] && [ -n "$HTTP" ] && break
  kill -0 "$PID" 2>/dev/null || fail "daemon exited"
  sleep 0.1
done
[ -n "$PORT" ] && [ -n "$HTTP" ] || fail "daemon did not report its addresses"
CLI=(timeout 30 redis-cli -p "$PORT")

eq() { [ "$1" = "$2" ] || fail "expected '$2', got '$1' ($3)"; }
eq "$("${CLI[@]}" ping)" "PONG" ping
eq "$("${CLI[@]}" set greeting hello)" "OK" set
eq "$("${CLI[@]}" get greeting)" "hello" get
eq "$("${CLI[@]}" exists greeting nothing)" "1" exists
eq "$("${CLI[@]}" dbsize)" "1" dbsize
"${CLI[@]}" info | grep -q '^redis_version:' || fail "info has no redis_version"
"${CLI[@]}" info keyspace | grep -q '^db0:keys=1,' || fail "info keyspace"
eq "$("${CLI[@]}" del greeting nothing)" "1" del
eq "$("${CLI[@]}" --no-raw get greeting)" "(nil)" "get after del"
# COMMAND INFO as redis-cli renders it: name, arity, flags, key positions.
eq "$("${CLI[@]}" command info get | head -6 | tr '\n' ' ')" "get 2 readonly fast 1 1 " "command info"
eq "$("${CLI[@]}" command count)" "15" "command count"
eq "$("${CLI[@]}" command list | wc -l)" "15" "command list"
# --pipe (mass insertion) ends with an ECHO to know every reply came (QA:
# it waited 30 s and exited 1 before ECHO was served).
printf 'SET pa 1\r\nSET pb 2\r\nDEL pa pb\r\n' | timeout 20 redis-cli -p "$PORT" --pipe >"$TMP/pipe.out" 2>&1 ||
  fail "redis-cli --pipe: $(cat "$TMP/pipe.out")"
grep -q 'errors: 0, replies: 3' "$TMP/pipe.out" || fail "redis-cli --pipe: $(cat "$TMP/pipe.out")"
# --stat reads INFO's blocked_clients (QA: garbage in its column without it).
timeout 1 stdbuf -oL redis-cli -p "$PORT" --stat -i 0.2 >"$TMP/stat.out" 2>&1 || true
awk 'NR==3 { found = 1; if ($4 != "0") exit 1 } END { if (!found) exit 1 }' "$TMP/stat.out" ||
  fail "redis-cli --stat blocked column: $(cat "$TMP/stat.out")"
eq "$("${CLI[@]}" --no-raw nosuchcommand x)" "(error) ERR unknown command 'nosuchcommand', with args beginning with: 'x' " unknown

# A binary value with every byte value (NUL, CR, LF included) round-trips exactly.
python3 -c 'import sys; sys.stdout.buffer.write(bytes(range(256)) * 4096 + b"\r\n\x00tail")' >"$TMP/value.bin"
eq "$("${CLI[@]}" -x set "bin key" <"$TMP/value.bin")" "OK" "set -x"
"${CLI[@]}" --raw get "bin key" | head -c -1 >"$TMP/value.out"
cmp "$TMP/value.bin" "$TMP/value.out" || fail "binary value differs"
"${CLI[@]}" --no-raw get "bin key" >"$TMP/value.txt"
[ "$(head -c 9 "$TMP/value.txt")" = '"\x00\x01' ] || fail "--no-raw rendering: $(head -c 40 "$TMP/value.txt")"

# redis-benchmark: 256 KiB values, no errors.
BENCH=$(timeout 300 redis-benchmark -p "$PORT" -t set,get -n 2000 -d 262144 -c 4 -q 2>&1) || fail "redis-benchmark: $BENCH"
echo "$BENCH" | tr '\r' '\n' | grep 'requests per second'
echo "$BENCH" | grep -qi 'error' && fail "redis-benchmark reported errors: $BENCH"
echo "$BENCH" | tr '\r' '\n' | grep -q '^SET: .* requests per second' || fail "no SET result: $BENCH"
echo "$BENCH" | tr '\r' '\n' | grep -q '^GET: .* requests per second' || fail "no GET result: $BENCH"

# HTTP endpoint.
eq "$(curl -fsS "http://$HTTP/healthz")" "ok" healthz
METRICS=$(curl -fsS "http://$HTTP/metrics")
HITS=$(echo "$METRICS" | sed -n 's/^kvtier_hits_total{tier="ram"} //p')
[ -n "$HITS" ] && [ "$HITS" -ge 2000 ] || fail "hits after the benchmark: '$HITS'"
echo "$METRICS" | grep -q '^kvtier_requests_total{interface="resp"} ' || fail "resp requests metric"
curl -fsS "http://$HTTP/status" | python3 -c 'import json,sys; d=json.load(sys.stdin); assert d["store"]["puts"] >= 2000, d' \
  || fail "/status"
[ "$(curl -s -o /dev/null -w '%{http_code}' "http://$HTTP/nope")" = 404 ] || fail "404"

kill -TERM "$PID"
for _ in $(seq 1 100); do kill -0 "$PID" 2>/dev/null || break; sleep 0.1; done
kill -0 "$PID" 2>/dev/null && fail "daemon did not stop on SIGTERM"
wait "$PID" || fail "daemon exit status $?"
PID=
echo "40-redis-cli: 1 passed, 0 failed"
