#!/usr/bin/env bash
# Builds, on a machine with the package index, the kit that field-kits/field-gpu.sh installs on the GPU
# machine (which has no network, Python 3.12, CUDA 13, torch 2.11, and a 64 MiB carry limit).
# The wheels as published do not fit: nixl-cu13 1.3.2 (cp312) alone is 66,330,361 B (63.3 MiB),
# and KVBM's 14,891,253 B come on top. So the kit is their unpacked files, less what KVBM never
# loads (nixl_ep_cu13: NIXL's expert-parallel kernels, one 39 MB library per torch version; UCX's
# perf-test tools), packed with xz. It prints the kit's size; a kit over LIMIT_B is refused.
#   bash field-kits/field-kit.sh [kvbm|lmcache|lmcache-gpu|both]     # -> .field/kit-WHAT.tar.xz (.field is git-ignored)
# `lmcache-gpu` is LMCache less what the GPU machine's image already holds (numba, llvmlite,
# transformers, tokenizers, cuda-bindings, cupy, numpy, pyyaml, psutil, ...: KINDS.md's package list),
# which is what lets it travel beside KVBM's kit in one call.
set -euo pipefail
what="${1:-kvbm}"
root="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d)"; trap 'rm -rf "$work"' EXIT
limit=${LIMIT_B:-$((60 * 1024 * 1024))}   # 64 MiB less room for the working tree's own changes
get() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
          --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
          -d "$work/wheels" "$@"; }
kvbm_wheels() { get kvbm==1.6.1 nixl==1.3.2 nixl-cu13==1.3.2 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types \
                    typing-inspection typing-extensions; }
# LMCache 0.5.6's in-process TensorRT-LLM adapter: what its import and engine need besides torch and
# CUDA (found by importing it under `--compat trtllm` on the CPU: docs/field-connectors.md).
lmcache_wheels() { get lmcache==0.5.6 pyyaml msgspec pyzmq psutil prometheus-client aiofiles aiofile caio \
                       blake3 nvtx py-cpuinfo cachetools numba llvmlite transformers tokenizers safetensors \
                       huggingface-hub regex tqdm httpx h11 truststore typer-slim cryptography cffi pycparser \
                       opentelemetry-api opentelemetry-sdk opentelemetry-semantic-conventions \
                       opentelemetry-exporter-prometheus importlib-metadata zipp cuda-python cuda-bindings \
                       cuda-pathfinder; }   # numpy and cupy-cuda13x left out: see docs/field-connectors.md
lmcache_gpu_wheels() { get lmcache==0.5.6 msgspec pyzmq aiofile caio blake3 nvtx cachetools truststore typer-slim \
                           cryptography cffi pycparser opentelemetry-api opentelemetry-sdk \
                           opentelemetry-semantic-conventions opentelemetry-exporter-prometheus importlib-metadata \
                           cuda-python; }
case "$what" in
    kvbm) kvbm_wheels ;; lmcache) lmcache_wheels ;; lmcache-gpu) lmcache_gpu_wheels ;; both) kvbm_wheels; lmcache_wheels ;;
    *) echo "usage: $0 [kvbm|lmcache|lmcache-gpu|both]" >&2; exit 2 ;;
esac
ls -l "$work/wheels" | awk 'NR > 1 {print $5, $9}' | sort -n >"$work/wheel-sizes.txt"
mkdir -p "$work/site"
for wheel in "$work"/wheels/*.whl; do python3 -m zipfile -e "$wheel" "$work/site"; done
rm -rf "$work"/site/nixl_ep_cu13* "$work"/site/nixl_cu13.libs/ucx/libucx_perftest* "$work"/site/*.dist-info/sboms \
       "$work"/site/*.dist-info/licenses/THIRD-PARTY-RUST-LICENSES.txt
mkdir -p "$root/.field"
kit="$root/.field/kit-$what.tar.xz"
tar -C "$work" -cf - site | xz -9e -T0 >"$kit"
cp "$work/wheel-sizes.txt" "$root/.field/wheel-sizes-$what.txt"
size=$(stat -c %s "$kit")
echo "$kit: $size bytes (limit $limit); wheels: $(awk '{s += $1} END {print s}' "$work/wheel-sizes.txt") bytes"
[ "$size" -le "$limit" ] || { echo "the kit does not fit the carry limit" >&2; exit 1; }
