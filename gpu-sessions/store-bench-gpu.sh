#!/usr/bin/env bash
# The GPU session behind results/protocol-store-bench* (issue 41): the store bench through the protocol
# on GPU pages, where its time goes with the staged backend as it was (BEFORE, default `staged-runs`:
# one cuMemcpyAsync per direct run; `staged-gather`: every batch gathered) and as it is, the
# overlapping modes beside a forward's products, and the GPU tests of the paths it changed. Run on the
# GPU machine from a checkout (after the device wheels are on PYTHONPATH: ../shared/DEVICE.md); writes
# under $OUT. Each step has its own time limit, so one slow step leaves the others' results (about
# 490 s in all; WITH_LAYERWISE=1 adds host-layerwise beside products, 80 s more; SKIP_GPU_TESTS=1
# leaves out the tests; SKIP_BEFORE=1 the breakdown of the BEFORE backend).
set -u
out="${OUT:?set OUT to the folder for the results}"
step() {   # NAME SECONDS COMMAND...: run, its output in $out/NAME.log, its exit code in the log's last line
    local name=$1 limit=$2
    shift 2
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    echo "exit $?" >>"$out/$name.log"
    tail -n 1 "$out/$name.log" | sed "s/^/$name: /"
}
nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv >"$out/gpu.csv" 2>&1
step raw 40 python3 gpu-sessions/store-breakdown.py "$out/breakdown" --part raw --backends "${BEFORE:-staged-runs},staged,batch" \
    --raw-pages 2097152,4194304 --raw-counts 128
step bench 160 python3 -m kvtool bench --suite store --device cuda --output "$out/bench"
if [ -z "${SKIP_BEFORE:-}" ]; then
    step breakdown-before 50 python3 gpu-sessions/store-breakdown.py "$out/breakdown" --part protocol \
        --backends "${BEFORE:-staged-runs}" --modes sync --workloads 8x16x8
fi
step breakdown-after 100 python3 gpu-sessions/store-breakdown.py "$out/breakdown" --part protocol --backends staged \
    --modes sync,async,layerwise --workloads 8x4x8,8x16x8 --profile
step bench-async 70 python3 -m kvtool bench --suite store --device cuda --connector host --connector-opt mode=async \
    --with-compute --repeats 1 --output "$out/bench-async"
if [ -n "${WITH_LAYERWISE:-}" ]; then
    step bench-layerwise 80 python3 -m kvtool bench --suite store --device cuda \
        --connector host --connector-opt mode=layerwise --with-compute --repeats 1 --output "$out/bench-layerwise"
fi
if [ -z "${SKIP_GPU_TESTS:-}" ]; then
    step gpu-tests 70 python3 -m pytest -q -p no:cacheprovider -n 0 tests/gpu/test_backends.py \
        tests/gpu/test_bench_gpu.py tests/gpu/test_validate_determinism_gpu.py
fi
