#!/usr/bin/env bash
# Builds the `genfleet` executable of the previous release, for tests/upgrade.rs (a worker of
# the previous release beside one of this release in one pool). The release is the commit in
# tests/data/previous-release; this checkout's git history must hold it (a shallow clone is
# deepened with `git fetch`).
#
# The sources of that commit are extracted (git archive) under target/previous-release/ and
# built in this checkout's target directory, so the dependencies this checkout already built
# are reused when the two lock files agree; the executable is named genfleet-previous there, so
# that it never takes the place of this release's target/debug/genfleet. Built once per commit.
#
# Prints GENFLEET_PREVIOUS_RELEASE=<path of the executable> on stdout; what it does on stderr.
set -euo pipefail
cd "$(dirname "$0")/.."
say() { printf '==> %s\n' "$*" >&2; }

read -r commit name < <(grep -v '^#' tests/data/previous-release)
target="${CARGO_TARGET_DIR:-$PWD/target}"
dir="$target/previous-release/$commit"
exe="$dir/genfleet"
if [ ! -x "$exe" ]; then
  if ! git cat-file -e "$commit^{commit}" 2>/dev/null; then
    say "fetching the previous release ($name, $commit) from origin"
    git fetch -q origin "$commit" >&2 || {
      echo "previous-release: commit $commit ($name) is not in this checkout and cannot be fetched; clone with its history" >&2
      exit 1
    }
  fi
  say "building the previous release's worker ($name, ${commit:0:10}) under $dir"
  rm -rf "$dir"
  mkdir -p "$dir/src"
  git archive "$commit" | tar -x -C "$dir/src"
  # Its own workspace; its executable named apart from this release's.
  python3 - "$dir/src/Cargo.toml" <<'PY'
import re, sys
path = sys.argv[1]
text = open(path).read()
text = re.sub(r'(?m)^default-run = .*\n', '', text)
text = re.sub(r'(\[\[bin\]\]\nname = )"genfleet"', r'\1"genfleet-previous"', text, count=1)
if "genfleet-previous" not in text:
    sys.exit("previous-release: no [[bin]] genfleet in " + path)
text += "\n[workspace]\n"
open(path, "w").write(text)
PY
  (cd "$dir/src" && CARGO_TARGET_DIR="$target" cargo build --quiet --locked --bin genfleet-previous >&2)
  cp "$target/debug/genfleet-previous" "$exe.tmp"
  mv "$exe.tmp" "$exe"
fi
echo "GENFLEET_PREVIOUS_RELEASE=$exe"
