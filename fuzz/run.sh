#!/usr/bin/env bash
# Runs every fuzz target for SECONDS each (default 20) from its committed
# corpus, and prints execs and crashes per target. Needs cargo-fuzz; on a
# stable toolchain RUSTC_BOOTSTRAP=1 lets it use the sanitizer flags.
# New inputs go to a scratch copy: the committed corpus stays the seeds.
set -euo pipefail
cd "$(dirname "$0")"
seconds="${1:-20}"
export RUSTC_BOOTSTRAP=1
targets=$(sed -n 's/^name = "\(.*\)"$/\1/p' Cargo.toml | grep -v '^ojs-bridge-fuzz$')
cargo fuzz build -O >/dev/null
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
status=0
for t in $targets; do
  mkdir -p "$scratch/$t"
  cp corpus/"$t"/* "$scratch/$t"/
  log="$scratch/$t.log"
  if cargo fuzz run -O "$t" "$scratch/$t" -- -max_total_time="$seconds" -rss_limit_mb=2048 >"$log" 2>&1; then
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
exit $status
