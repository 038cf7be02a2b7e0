# Shared by the scripts: say what is done, and install Debian/Ubuntu packages when missing.

say() { printf '==> %s\n' "$*"; }
as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

apt_updated=""
apt_install() {
  if [ -z "$apt_updated" ]; then
    say "updating the package lists (apt-get update)"
    as_root apt-get update -qq
    apt_updated=1
  fi
  say "installing $* (apt-get install)"
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

# nats-server from the system package manager (Debian puts it in /usr/sbin). The tests start
# $NATS_SERVER instead when it is set (another release, say); so does the demo.
ensure_nats_server() {
  export PATH="$PATH:/usr/sbin:/usr/local/bin"
  if [ -n "${NATS_SERVER:-}" ]; then
    if [ ! -x "$NATS_SERVER" ]; then
      echo "NATS_SERVER=$NATS_SERVER is not an executable nats-server" >&2
      exit 1
    fi
    say "nats-server: $("$NATS_SERVER" --version) (NATS_SERVER=$NATS_SERVER)"
    return
  fi
  if ! command -v nats-server >/dev/null 2>&1; then
    apt_install nats-server
  fi
  say "nats-server: $(nats-server --version)"
}

# Debian's Chromium and playwright-core (into tests/console/node_modules, at the version
# tests/console/package-lock.json pins) for the console's browser test. Sets
# GENFLEET_TEST_CHROMIUM, GENFLEET_TEST_NODE_MODULES and GENFLEET_TEST_NODE.
ensure_browser_test_tools() {
  if ! command -v chromium >/dev/null 2>&1; then
    apt_install chromium
  fi
  if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
    apt_install nodejs npm
  fi
  local major
  major="$(node -p 'process.versions.node.split(".")[0]')"
  if [ "$major" -lt 20 ]; then
    echo "the console's browser test needs Node.js 20 or later (playwright-core); found $(node --version)" >&2
    echo "install a newer Node.js, or set GENFLEET_TEST_SKIP_BROWSER=1 to skip that test" >&2
    exit 1
  fi
  local dir=tests/console wanted have
  wanted="$(node -p "require('./$dir/package-lock.json').packages['node_modules/playwright-core'].version")"
  have="$(node -p "try { require('./$dir/node_modules/playwright-core/package.json').version } catch (e) { '' }")"
  if [ "$have" != "$wanted" ]; then
    say "installing playwright-core $wanted into $dir/node_modules (npm ci, for the console's browser test)"
    (cd "$dir" && npm ci --no-audit --no-fund --loglevel=error)
  fi
  GENFLEET_TEST_CHROMIUM="$(command -v chromium)"
  GENFLEET_TEST_NODE_MODULES="$PWD/$dir/node_modules"
  GENFLEET_TEST_NODE="$(command -v node)"
  say "browser test: $("$GENFLEET_TEST_CHROMIUM" --version 2>/dev/null || echo chromium), playwright-core $wanted, node $(node --version)"
}
