#!/usr/bin/env bash
# Builds llama.cpp's llama-server from source, offline: the llama.cpp that PyPI's llama-cpp-python sdist vendors.
# Usage: build_llama_server.sh OUT_DIR [LLAMA_CPP_PYTHON_VERSION]
# Leaves OUT_DIR/llama-server (the binary, statically linked to llama.cpp) and OUT_DIR/llama-server.commit.
# A second run with the same version does nothing. Needs CMake, a C++ compiler and ninja (installed from Debian
# when missing and running as root), and pip to fetch the sdist. About 10 minutes on 2 idle cores.
set -euo pipefail
out_dir=$(realpath -m "$1")
version=${2:-0.3.36}
pip=${PIP:-pip}
stamp="$out_dir/llama-server.version"
build="$version, AMX off"  # what the stamp records: a build of another kind is rebuilt
if [ -x "$out_dir/llama-server" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$build" ]; then
    echo "llama-server $version already built in $out_dir"; exit 0
fi
missing=""
for tool in cmake ninja g++; do command -v "$tool" >/dev/null 2>&1 || missing="$missing $tool"; done
if [ -n "$missing" ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "installing Debian's cmake, ninja-build and g++ (missing:$missing)"
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends cmake ninja-build g++ >/dev/null
    else
        echo "llama-server needs$missing; install them (Debian: cmake ninja-build g++) and run again" >&2; exit 1
    fi
fi
work="$out_dir/build-$version"
rm -rf "$work" && mkdir -p "$work"
"$pip" download -q --no-deps --no-binary :all: -d "$work" "llama-cpp-python==$version"
tar -xzf "$work"/llama_cpp_python-"$version".tar.gz -C "$work"
source_dir=$(realpath "$work/llama_cpp_python-$version/vendor/llama.cpp")  # by its real path: CMake mishandles a symlink
# The sdist carries no git history; its changelog names the llama.cpp commit it vendors.
commit=$(grep -m1 -o 'ggml-org/llama.cpp@[0-9a-f]*' "$work/llama_cpp_python-$version/CHANGELOG.md" | cut -d@ -f2)
# This CPU's instruction sets less AMX (GGML_NATIVE's -march=native would enable it): ggml's AMX matmuls crash
# (SIGSEGV in ggml_backend_amx_mul_mat) where the kernel does not grant a process the AMX tile state, as on the VMs
# these benchmarks run on. AVX-512, VNNI and llama.cpp's repacked weight layouts stay.
cpu_flags=$(grep -m1 '^flags' /proc/cpuinfo || true)
isa=""
for pair in avx:AVX avx2:AVX2 fma:FMA f16c:F16C bmi2:BMI2 avx_vnni:AVX_VNNI avx512f:AVX512 avx512vbmi:AVX512_VBMI \
            avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16; do
    if [[ " $cpu_flags " == *" ${pair%%:*} "* ]]; then isa="$isa -DGGML_${pair##*:}=ON"; fi
done
# shellcheck disable=SC2086  # $isa is a list of flags
cmake -S "$source_dir" -B "$work/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
    -DGGML_NATIVE=OFF $isa -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF >/dev/null
cmake --build "$work/build" --target llama-server -j "$(nproc)"
install -m 755 "$work/build/bin/llama-server" "$out_dir/llama-server"
echo "$commit" > "$out_dir/llama-server.commit"
echo "$build" > "$stamp"
rm -rf "$work"
echo "llama-server (llama.cpp $commit, from llama-cpp-python $version) built in $out_dir"
