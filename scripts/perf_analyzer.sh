#!/usr/bin/env bash
# Makes perf_analyzer runnable here and runs it: `scripts/perf_analyzer.sh -m mol2 -i grpc ...`.
# The PyPI perf-analyzer wheel is built for glibc 2.38. On an older glibc (Debian 12 has 2.36) it runs through a
# private loader: Debian 13's libc6, libstdc++6 and libgcc-s1 are downloaded with apt-get (their own sources file
# and state folders, the system's apt setup untouched; the archive address is read from the machine's own sources)
# and unpacked into artifacts/perf_analyzer/root. Everything lands under artifacts/perf_analyzer on first use.
set -euo pipefail
cd "$(dirname "$0")/.."
PRIVATE="$(pwd)/artifacts/perf_analyzer"
BIN="$PRIVATE/pkg/perf_analyzer/bin/perf_analyzer"
if [ ! -x "$BIN" ]; then  # pip will not install a manylinux_2_38 wheel on an older glibc: unpack it instead
  mkdir -p "$PRIVATE/wheel" "$PRIVATE/pkg"
  python3 -m pip download --quiet --no-deps --only-binary=:all: --platform manylinux_2_38_x86_64 \
      -d "$PRIVATE/wheel" "perf-analyzer==2.60.0" 2>/dev/null
  python3 -m zipfile -e "$PRIVATE"/wheel/perf_analyzer-2.60.0-*.whl "$PRIVATE/pkg"
  chmod +x "$BIN"
fi
glibc=$(getconf GNU_LIBC_VERSION | awk '{print $2}')  # not `ldd --version | head`: SIGPIPE under pipefail
if printf '%s\n2.38\n' "$glibc" | sort -V -C; then  # glibc older than 2.38: use the private loader
  ROOTFS="$PRIVATE/root"
  if [ ! -e "$ROOTFS/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2" ]; then
    mirror=$(cat /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2>/dev/null \
             | grep -oE 'https?://[^ ]+/debian/?( |$)' | grep -v security | head -n1 | tr -d ' ' || true)
    [ -n "$mirror" ] || { echo "no Debian archive found in the apt sources" >&2; exit 1; }
    mkdir -p "$PRIVATE/apt/lists/partial" "$PRIVATE/apt/cache/archives/partial" "$PRIVATE/debs" "$ROOTFS"
    echo "deb [trusted=yes] ${mirror%/} trixie main" > "$PRIVATE/apt/trixie.list"
    opts=(-o Dir::Etc::SourceList="$PRIVATE/apt/trixie.list" -o Dir::Etc::SourceParts=/dev/null
          -o Dir::State::Lists="$PRIVATE/apt/lists" -o Dir::Cache="$PRIVATE/apt/cache" -o Debug::NoLocking=1)
    apt-get "${opts[@]}" update -qq
    (cd "$PRIVATE/debs" && apt-get "${opts[@]}" download -qq libc6 libstdc++6 libgcc-s1)
    for deb in "$PRIVATE"/debs/*.deb; do dpkg -x "$deb" "$ROOTFS"; done
  fi
  LIBS="$ROOTFS/usr/lib/x86_64-linux-gnu"
  exec "$LIBS/ld-linux-x86-64.so.2" --library-path "$LIBS" "$BIN" "$@"
fi
exec "$BIN" "$@"
