#!/usr/bin/env bash
# Installs the benchmark peer llama.cpp into a folder of its own: .peers/llamacpp (git-ignored).
#   bin/llama-server, bin/llama-bench  built, CPU only, from the llama.cpp tree that the PyPI sdist of
#                                      llama-cpp-python==$VERSION vendors (no binary wheel: the source is built here)
#   src/                               that tree (convert_hf_to_gguf.py, convert_lora_to_gguf.py, gguf-py/)
#   venv/                              the converters' Python: torch==2.13.0 (the on-disk CPU build), transformers,
#                                      gguf (PyPI; its dependencies: the converters import the vendored gguf-py
#                                      beside them, which matches the tree)
# The build fetches nothing: the server's web UI is neither downloaded (LLAMA_USE_PREBUILT_UI=OFF) nor built with
# npm (LLAMA_BUILD_UI=OFF); no HTTPS client (LLAMA_OPENSSL=OFF), no llguidance, no OpenMP fetch, FetchContent
# disconnected. Idempotent: a folder whose stamp names this version and whose binaries and venv work is left as it
# is. Used by benchmarks/peer_llamacpp.py (serving_throughput, turn_cost): without it their llama.cpp rows are
# skipped. Building takes ~10-20 min on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VERSION=0.3.36
DEST=.peers/llamacpp
JOBS=${JOBS:-$(nproc)}
STAMP="$DEST/installed.txt"

fail() { echo "install_llamacpp: $*" >&2; exit 1; }

works() {
  [ -x "$DEST/bin/llama-server" ] && [ -x "$DEST/bin/llama-bench" ] \
    && "$DEST/bin/llama-server" --version >/dev/null 2>&1 \
    && "$DEST/venv/bin/python" -c 'import torch, transformers, gguf' >/dev/null 2>&1 \
    && [ -f "$DEST/src/convert_hf_to_gguf.py" ] && [ -f "$DEST/src/convert_lora_to_gguf.py" ]
}

if [ -f "$STAMP" ] && grep -qx "llama-cpp-python $VERSION" "$STAMP" && works; then
  echo "llama.cpp (vendored by llama-cpp-python $VERSION) already in $(pwd)/$DEST"
  exit 0
fi
for tool in cmake c++ tar; do
  command -v "$tool" >/dev/null || fail "needs $tool (apt-get install cmake g++)"
done
mkdir -p "$DEST"
rm -f "$STAMP"

# 1. The converters' venv (also the pip that downloads the sdist).
[ -x "$DEST/venv/bin/python" ] || "$PYTHON" -m venv "$DEST/venv" || fail "could not create $DEST/venv"
PIP=("$DEST/venv/bin/python" -m pip install --quiet --disable-pip-version-check)
"${PIP[@]}" "torch==2.13.0" || fail "pip could not install torch==2.13.0 into $DEST/venv"
"${PIP[@]}" "torch==2.13.0" transformers safetensors gguf sentencepiece || fail "pip failed on the converters' deps"
echo "converters' venv ready: $DEST/venv"

# 2. The source: the sdist's vendor/llama.cpp.
if [ ! -f "$DEST/src/CMakeLists.txt" ] || [ ! -f "$DEST/src/.from-$VERSION" ]; then
  download=$(mktemp -d)
  trap 'rm -rf "$download"' EXIT
  "$DEST/venv/bin/python" -m pip download --quiet --disable-pip-version-check --no-binary :all: --no-deps \
    "llama-cpp-python==$VERSION" -d "$download" || fail "pip could not download the llama-cpp-python $VERSION sdist"
  tar xzf "$download/llama_cpp_python-$VERSION.tar.gz" -C "$download" || fail "could not unpack the sdist"
  [ -f "$download/llama_cpp_python-$VERSION/vendor/llama.cpp/CMakeLists.txt" ] \
    || fail "the sdist has no vendor/llama.cpp"
  rm -rf "$DEST/src"
  mv "$download/llama_cpp_python-$VERSION/vendor/llama.cpp" "$DEST/src"
  touch "$DEST/src/.from-$VERSION"
  echo "unpacked llama.cpp from the llama-cpp-python $VERSION sdist into $DEST/src"
fi

# 3. The build. GIT_CEILING_DIRECTORIES: the tree has no .git of its own; without a ceiling its build-info would
# take this project's commit for llama.cpp's.
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
GIT_CEILING_DIRECTORIES="$(pwd)/$DEST" cmake -S "$DEST/src" -B "$DEST/build" "${generator[@]}" \
  -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=ON \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
  -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_LLGUIDANCE=OFF \
  -DGGML_OPENMP_FETCH=OFF -DGGML_CUDA=OFF -DGGML_VULKAN=OFF -DGGML_METAL=OFF -DGGML_BLAS=OFF \
  -DFETCHCONTENT_FULLY_DISCONNECTED=ON >"$DEST/cmake-configure.log" 2>&1 \
  || fail "cmake configure failed; see $DEST/cmake-configure.log"
echo "configured $DEST/build (log $DEST/cmake-configure.log); building with $JOBS jobs"
cmake --build "$DEST/build" --target llama-server llama-bench -j "$JOBS" >"$DEST/cmake-build.log" 2>&1 \
  || fail "the build failed; see $DEST/cmake-build.log"
mkdir -p "$DEST/bin"
cp "$DEST/build/bin/llama-server" "$DEST/build/bin/llama-bench" "$DEST/bin/"

works || fail "built, but llama-server --version or the converters' imports fail"
echo "llama-cpp-python $VERSION" >"$STAMP"
echo "installed llama.cpp into $(pwd)/$DEST: $("$DEST/bin/llama-server" --version 2>&1 | head -1)"
