#!/usr/bin/env bash
# Runs genfleet's fuzz targets (fuzz/, cargo fuzz with libFuzzer) for a while each, and fails on
# the first crash, hang or runaway allocation. See docs/fuzzing.md.
#
#   scripts/fuzz.sh                      # every target, 30 s each
#   scripts/fuzz.sh 20                   # every target, 20 s each (what CI runs)
#   scripts/fuzz.sh 3600 loop_detector   # one target for an hour
#
# Installs what is missing first and says so: cargo-fuzz (cargo install, pinned version) and a
# C++ compiler (libFuzzer is C++). Works on stable Rust: RUSTC_BOOTSTRAP=1 lets cargo fuzz pass
# the unstable flags it needs, and the sanitizer is off (safe Rust: what we look for is panics,
# hangs and unbounded memory, which libFuzzer catches itself).
#
# Each run starts from the checked-in corpus (fuzz/corpus/<target>, read only) and writes what
# it finds to fuzz/target/corpus/<target>; docs/fuzzing.md says how to fold that in. A crash is
# written to fuzz/artifacts/<target>/ with the command that replays it.
set -euo pipefail
cd "$(dirname "$0")/.."

# shellcheck source=scripts/lib.sh
. scripts/lib.sh

CARGO_FUZZ_VERSION=0.13.2
seconds="${1:-30}"
shift || true
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  targets=(decode_request_json decode_request_msgpack text_call_parser loop_detector signal_validation)
fi

if ! command -v c++ >/dev/null 2>&1; then
  apt_install g++
fi
if ! cargo fuzz --version 2>/dev/null | grep -q "$CARGO_FUZZ_VERSION"; then
  say "installing cargo-fuzz $CARGO_FUZZ_VERSION (cargo install, about a minute)"
  cargo install --quiet --locked --version "$CARGO_FUZZ_VERSION" cargo-fuzz
fi

export RUSTC_BOOTSTRAP=1
cd fuzz
say "building the fuzz targets (release, with coverage instrumentation)"
cargo fuzz build --sanitizer none --fuzz-dir .

for target in "${targets[@]}"; do
  found="target/corpus/$target"
  mkdir -p "$found" "corpus/$target"
  say "fuzzing $target for ${seconds}s (seeds: fuzz/corpus/$target)"
  if ! cargo fuzz run --sanitizer none --fuzz-dir . "$target" "$found" "corpus/$target" -- \
    -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
    -print_final_stats=1 2> "target/$target.log"; then
    tail -n 60 "target/$target.log"
    say "$target failed: the input is in fuzz/artifacts/$target/ (see above for how to replay it)"
    exit 1
  fi
  grep -E '^(Done|stat::number_of_executed_units|stat::peak_rss_mb)' "target/$target.log" || true
  say "$target: no crash, $(find "$found" -type f | wc -l) new corpus entries in fuzz/target/corpus/$target"
done
