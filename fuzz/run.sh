#!/usr/bin/env bash
# Runs fuzz targets for SECONDS each (default 20) from their committed
# corpus, and prints execs and crashes per target. Needs cargo-fuzz; on a
# stable toolchain RUSTC_BOOTSTRAP=1 lets it use the sanitizer flags.
#
#   fuzz/run.sh [SECONDS] [core|daemon|api|all]     (default: core)
#
# core:   the envelope's and grpcq's wire-format decoders (fuzz/), under AddressSanitizer.
# api:    the OJS API's request parsing and validation (fuzz/api/), under
#         AddressSanitizer; its build compiles tonic, the PostgreSQL client
#         and SQLite (over ten minutes on 2 cores), which is why CI replays
#         its corpus in `cargo test` instead.
# daemon: the daemon's decoders: configuration, adapter headers,
#         descriptor-set transcoding (fuzz/daemon/). Built without a
#         sanitizer: librdkafka's C dependencies do not link under ASan, and
#         the Rust code on the fuzzed paths has no unsafe. The build compiles librdkafka and the
#         AWS SDK (about 8 minutes on 2 cores), which is why CI runs `core`.
#
# New inputs go to a scratch copy: the committed corpus stays the seeds.
set -euo pipefail
cd "$(dirname "$0")"
seconds="${1:-20}"
which="${2:-core}"
export RUSTC_BOOTSTRAP=1
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
status=0

run_crate() { # dir sanitizer
  local dir=$1 sanitizer=$2 targets t log result execs
  targets=$(sed -n 's/^name = "\(.*\)"$/\1/p' "$dir/Cargo.toml" | grep -v '^ojs-bridge-fuzz')
  (cd "$dir" && cargo fuzz build -O -s "$sanitizer" --fuzz-dir . >/dev/null)
  for t in $targets; do
    mkdir -p "$scratch/$t"
    cp corpus/"$t"/* "$scratch/$t"/
    log="$scratch/$t.log"
    if (cd "$dir" && cargo fuzz run -O -s "$sanitizer" --fuzz-dir . "$t" "$scratch/$t" -- \
        -max_total_time="$seconds" -rss_limit_mb=2048 >"$log" 2>&1); then
      result=ok
    else
      result=CRASH
      status=1
    fi
    execs=$(grep -o 'Done [0-9]* runs' "$log" | grep -o '[0-9]*' || echo "?")
    echo "fuzz $t: $result, $execs execs in ${seconds}s"
    if [ "$result" = CRASH ]; then
      tail -40 "$log"
    fi
  done
}

case "$which" in
  core) run_crate . address ;;
  daemon) run_crate daemon none ;;
  api) run_crate api address ;;
  all) run_crate . address; run_crate api address; run_crate daemon none ;;
  *) echo "usage: $0 [SECONDS] [core|daemon|api|all]" >&2; exit 2 ;;
esac
exit $status
