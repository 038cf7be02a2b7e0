#!/usr/bin/env bash
# The demo in one command: installs nats-server when it is missing, builds genfleet (the same
# debug build the tests use, so nothing is built twice), then runs `genfleet demo`: a private
# nats-server, the mock backend, a worker, a tool service and a manager, and a job that calls a
# tool, asks for a decision, is answered by the manager and finishes in a continuation.
# Ctrl-C stops everything it started.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/lib.sh
. scripts/lib.sh

ensure_nats_server
say "building genfleet (cargo build; the first time takes a few minutes)"
cargo build --quiet
say "running the demo (genfleet demo)"
exec cargo run --quiet -- demo --nats-server "${NATS_SERVER:-$(command -v nats-server)}" "$@"
