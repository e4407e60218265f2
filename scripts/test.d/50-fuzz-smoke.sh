#!/usr/bin/env bash
# Fuzz smoke: builds every cargo-fuzz target in fuzz/fuzz_targets and runs each
# for a short time (STYLE.md rule 27). Never runs in --quick mode.
#
# cargo-fuzz comes from crates.io (`cargo install cargo-fuzz --locked`) when it
# is missing. Its targets need nightly flags (-Zsanitizer, ...), so this runs
# the installed stable toolchain with RUSTC_BOOTSTRAP=1.
#
#   FUZZ_SECONDS   seconds per target (default 20; 60 in --full mode)
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
MODE=${MODE:-default}
if [ "$MODE" = "--quick" ]; then
  echo "fuzz smoke: skipped in --quick mode"
  exit 0
fi
if [ "$MODE" = "--full" ]; then
  SECONDS_PER_TARGET=${FUZZ_SECONDS:-60}
else
  SECONDS_PER_TARGET=${FUZZ_SECONDS:-20}
fi

if ! command -v cargo-fuzz >/dev/null 2>&1; then
  echo "fuzz smoke: cargo-fuzz is missing; installing it from crates.io"
  if ! cargo install cargo-fuzz --locked; then
    echo "fuzz smoke: FAILED: 'cargo install cargo-fuzz --locked' did not build (see above);" \
      "the fuzz targets cannot be run without it" >&2
    exit 1
  fi
fi

export RUSTC_BOOTSTRAP=1
# The fuzz crate is standalone with its own committed lock file.
if ! cargo metadata --locked --format-version 1 --manifest-path fuzz/Cargo.toml >/dev/null; then
  echo "fuzz smoke: FAILED: fuzz/Cargo.lock is out of date (a crate it fuzzes changed its" \
    "dependencies); run 'cargo update --workspace --manifest-path fuzz/Cargo.toml' and commit it" >&2
  exit 1
fi

mapfile -t targets < <(find fuzz/fuzz_targets -maxdepth 1 -name '*.rs' -printf '%f\n' | sed 's/\.rs$//' | sort)
if [ ${#targets[@]} -eq 0 ]; then
  echo "fuzz smoke: FAILED: no targets in fuzz/fuzz_targets" >&2
  exit 1
fi

echo "fuzz smoke: building ${#targets[@]} target(s): ${targets[*]}"
cargo fuzz build --fuzz-dir fuzz

failed=()
for t in "${targets[@]}"; do
  corpus=("fuzz/corpus/$t")
  mkdir -p "fuzz/corpus/$t"
  # Committed seed inputs (e.g. golden fixtures), read but never written.
  [ -d "fuzz/seeds/$t" ] && corpus+=("fuzz/seeds/$t")
  echo "fuzz smoke: $t for ${SECONDS_PER_TARGET}s"
  if ! cargo fuzz run --fuzz-dir fuzz "$t" "${corpus[@]}" -- \
      -max_total_time="$SECONDS_PER_TARGET" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1; then
    echo "fuzz smoke: target $t FAILED; reproducer under $ROOT/fuzz/artifacts/$t/" >&2
    failed+=("$t")
  fi
done

if [ ${#failed[@]} -ne 0 ]; then
  echo "fuzz smoke: FAILED targets: ${failed[*]}" >&2
  exit 1
fi
echo "fuzz smoke: all ${#targets[@]} target(s) ran clean"
