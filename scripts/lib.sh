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

# nats-server from the system package manager (Debian puts it in /usr/sbin).
ensure_nats_server() {
  export PATH="$PATH:/usr/sbin:/usr/local/bin"
  if ! command -v nats-server >/dev/null 2>&1; then
    apt_install nats-server
  fi
  say "nats-server: $(nats-server --version)"
}
