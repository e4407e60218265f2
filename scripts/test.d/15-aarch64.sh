#!/usr/bin/env bash
# kvtier's first home is DGX Spark, an aarch64 machine: every change must
# build there with no warnings. This lints the whole workspace for
# aarch64-unknown-linux-gnu (clippy, all targets and features, -D warnings),
# with Debian's cross C compiler for the crates that build C (ring).
#
# Where the target's standard library cannot be installed (no rustup, no
# network) it prints SKIPPED and passes, unless KVTEST_REQUIRE_AARCH64=1.
#
# KVTEST_AARCH64_QEMU=1 (not in CI: about 10 minutes on 2 cores) also runs
# the unit and in-process tests of kvtier-tier, kvtier-peer, kvtier-node and
# kvtier-cli on an emulated aarch64 CPU (qemu-user, Debian qemu-user-static).
# Left out there: the tests that start another process (qemu-user runs only
# the test binary itself), two that read the host kernel's view of the
# process (qemu ignores madvise, and its own code faults pages), and one
# whose bound assumes a native CPU's speed (a serve rate's 1 s timeout).
set -euo pipefail
cd "$(dirname "$0")/../.."

TARGET=aarch64-unknown-linux-gnu
skip() {
  echo "15-aarch64: SKIPPED: $*"
  [ "${KVTEST_REQUIRE_AARCH64:-0}" = 1 ] && exit 1
  exit 0
}

# shellcheck source=../lib/apt.sh
. scripts/lib/apt.sh

# The lint's metadata takes about 0.5 GB beside the host build.
free_kib=$(df -Pk . | awk 'NR == 2 { print $4 }')
[ "${free_kib:-0}" -ge $((2 << 20)) ] || skip "under 2 GiB free for the $TARGET build"
if ! rustup target list --installed 2>/dev/null | grep -qx "$TARGET"; then
  command -v rustup >/dev/null 2>&1 || skip "no rustup to install the $TARGET standard library"
  timeout 300 rustup target add "$TARGET" || skip "rustup could not install $TARGET"
fi
need_apt aarch64-linux-gnu-gcc:gcc-aarch64-linux-gnu ||
  skip "could not install gcc-aarch64-linux-gnu"
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc

echo "cargo clippy --target $TARGET"
cargo clippy --locked --workspace --all-targets --all-features --target "$TARGET" -- -D warnings

if [ "${KVTEST_AARCH64_QEMU:-0}" = 1 ]; then
  need_apt qemu-aarch64-static:qemu-user-static || {
    echo "15-aarch64: FAIL: could not install qemu-user-static" >&2
    exit 1
  }
  export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64-static -L /usr/aarch64-linux-gnu"
  echo "tests under qemu-aarch64"
  cargo test --locked --target "$TARGET" -p kvtier-tier -p kvtier-peer -p kvtier-node -p kvtier-cli \
    --lib --tests --no-fail-fast -- \
    --skip new_large_buffers_ask_for_huge_pages_only_when_configured \
    --skip freed_chunk_buffers_are_reused_without_faults_once_tuned \
    --skip kill_9_loop_never_loses_flushed_chunks \
    --skip a_failed_preallocation_leaves_no_store_file_behind \
    --skip a_serve_rate_serves_whole_chunks_in_turn
fi
echo "15-aarch64: ok"
