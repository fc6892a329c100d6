#!/usr/bin/env bash
# Builds llama.cpp's `llama-server` (CPU, AVX2) from the source vendored in the llama-cpp-python sdist, for
# benchmarks/cpu_vs_llama_cpp.py; prints the binary's path on stdout.
#
#   benchmarks/build_llama_cpp.sh [--version 0.3.36] [--cache-dir DIR] [--jobs 2]
#
# The binary lands in DIR/<version>/bin/llama-server (DIR: $LLAMA_CPP_BUILD_DIR or
# ~/.cache/pagedllm/llama.cpp). A second run finds it and only prints the path. The version is pinned so that
# figures recorded in docs/performance.md can be rebuilt; `--version` picks another release of the sdist.
# Build options: x86-64 with AVX2/FMA/F16C, not tuned to the build machine (-DGGML_NATIVE=OFF), no HTTPS,
# no web UI (nothing is fetched at build time), static libraries so the binary stands alone.
set -euo pipefail

version="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
cache_root="${LLAMA_CPP_BUILD_DIR:-$HOME/.cache/pagedllm/llama.cpp}"
jobs=2

while [ $# -gt 0 ]; do
    case "$1" in
        --version) version="$2"; shift 2 ;;
        --cache-dir) cache_root="$2"; shift 2 ;;
        --jobs) jobs="$2"; shift 2 ;;
        -h|--help) sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "build_llama_cpp.sh: unknown argument '$1' (expected --version, --cache-dir, --jobs)" >&2; exit 2 ;;
    esac
done

if ! [[ "$version" =~ ^[0-9]+(\.[0-9]+)*$ ]]; then
    echo "build_llama_cpp.sh: --version '$version' is not a release number such as 0.3.36" >&2; exit 2
fi
if ! [[ "$jobs" =~ ^[1-9][0-9]*$ ]]; then
    echo "build_llama_cpp.sh: --jobs '$jobs' must be a positive integer" >&2; exit 2
fi
for tool in cmake c++ python3; do
    command -v "$tool" >/dev/null || { echo "build_llama_cpp.sh: '$tool' is needed and not on PATH" >&2; exit 1; }
done

root="$cache_root/$version"
binary="$root/bin/llama-server"
mkdir -p "$root"

# One build per version at a time: a second caller waits, then finds the binary.
exec 9>"$root/.lock"
flock 9

if [ -x "$binary" ] && "$binary" --version >/dev/null 2>&1; then
    echo "$binary"
    exit 0
fi

src="$root/src"
if [ ! -f "$src/CMakeLists.txt" ]; then
    dl="$root/download"
    rm -rf "$dl" "$src"
    mkdir -p "$dl"
    echo "downloading the llama-cpp-python $version sdist" >&2
    python3 -m pip download "llama-cpp-python==$version" --no-deps --no-binary :all: -d "$dl" >&2
    sdist=$(ls "$dl"/llama_cpp_python-"$version".tar.gz 2>/dev/null || true)
    if [ -z "$sdist" ]; then
        echo "build_llama_cpp.sh: pip saved no llama_cpp_python-$version.tar.gz in $dl" >&2; exit 1
    fi
    tar -xzf "$sdist" -C "$dl" "llama_cpp_python-$version/vendor/llama.cpp"
    mv "$dl/llama_cpp_python-$version/vendor/llama.cpp" "$src"
    rm -rf "$dl"
fi

generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
build="$root/build"
echo "configuring llama.cpp in $build" >&2
cmake -S "$src" -B "$build" "${generator[@]}" \
    -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
    -DBUILD_SHARED_LIBS=OFF >&2
echo "building llama-server with $jobs jobs" >&2
start=$(date +%s)
cmake --build "$build" --target llama-server -j "$jobs" >&2
echo "built in $(( $(date +%s) - start )) s" >&2

mkdir -p "$root/bin"
cp "$build/bin/llama-server" "$binary.tmp"
mv "$binary.tmp" "$binary"
"$binary" --version >&2
echo "$binary"
