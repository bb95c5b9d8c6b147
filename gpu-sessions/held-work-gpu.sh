#!/usr/bin/env bash
# Issue 53 on one GPU: the stream races (`kvtool/engine/stream_races.py`) and held work on device pages.
#
# Run on the GPU machine from the repository root, with `.whl` carried and installed as for
# .ci/gpu-session (its header), OUT set to the folder whose files come back, then:
#   KVTOOL_COMMIT=<this commit> bash gpu-sessions/held-work-gpu.sh 1   # tests, planted connectors, async-vs-sync timing
#   KVTOOL_COMMIT=<this commit> bash gpu-sessions/held-work-gpu.sh 2   # 20 runs of host (pass expected)
#   KVTOOL_COMMIT=<this commit> bash gpu-sessions/held-work-gpu.sh 3   # 20 runs of the example (pass expected)
# Each part keeps within DEADLINE_S (default 560 s) and packs $OUT/held-work-gpu-PART.tgz after every
# step, so a run cut short returns what it finished. steps.txt: one line per step (rc, seconds);
# validate-summary.txt: each summary line with how often it came.
#   part 1: tests/gpu/test_stream_races_gpu.py (-n 0); the two planted stream-order connectors'
#           whole kit (expect exit 1, `integrity` failing with "so stream order decides"); the late
#           reader (expect exit 1); then host, host-async and a correct connector 5 ms slower a copy,
#           one after another, twice (timing.txt: seconds each, side by side on this machine).
#   parts 2 and 3: host, the example: 20 runs at the default seed, ten at once (--jobs 2 each; ten
#           host-async runs at once took about 4 minutes on the H200).
set -uo pipefail
export OMP_NUM_THREADS=1
part="${1:?which part: 1, 2 or 3}"
out="${OUT:?set OUT to the folder whose files come back}/held-work-gpu-$part"
mkdir -p "$out"
deadline=$(($(date +%s) + ${DEADLINE_S:-560}))
pack() { tar czf "$OUT/held-work-gpu-$part.tgz" -C "$OUT" "held-work-gpu-$part"; }
step() {   # NAME SECONDS COMMAND...: run within min(SECONDS, what is left before the deadline), log it
    local name=$1 limit=$2 t0 left; shift 2; t0=$(date +%s); left=$((deadline - t0))
    if [ "$left" -lt 20 ]; then echo "$name not run: deadline" >>"$out/steps.txt"; return; fi
    timeout "$((limit < left ? limit : left))" "$@" >"$out/$name.log" 2>&1
    echo "$name rc=$? $(($(date +%s) - t0))s" >>"$out/steps.txt"
}
validate() { step "$1" "$2" python3 -m kvtool validate "${@:3}" --device cuda --output "$out/$1" --format csv; }
summarize() { grep -h "checks:" "$out"/*.log | sed 's/^kvtool: error: //' | sort | uniq -c >"$out/validate-summary.txt"; pack; }
nvidia-smi --query-gpu=name,driver_version --format=csv >"$out/nvidia-smi.csv" 2>&1
echo "${KVTOOL_COMMIT:-unknown}" >"$out/commit.txt"
example=examples/dict_connector.py:DictConnectorScheduler:DictConnectorWorker
slow=tests/helpers/late_connectors.py:SlowPoolAsync:SlowPoolAsyncWorker

tests() {
    step tests-stream-races 200 python3 -m pytest -q -o addopts="" -p no:cacheprovider -rA \
        tests/gpu/test_stream_races_gpu.py --junitxml="$out/tests-stream-races.xml"
    pack
}
planted() {     # at once: each fails on its own, the GPU time-slices them
    validate planted-side-saves 200 tests/helpers/stream_connectors.py:SideStreamSaves:SideStreamSavesWorker --jobs 2 &
    validate planted-side-loads 200 tests/helpers/stream_connectors.py:SideStreamLoads:SideStreamLoadsWorker --jobs 2 &
    validate planted-late-reader 200 tests/helpers/late_connectors.py:LateReader:LateReaderWorker --jobs 2 &
    wait
    summarize
}
timing() {      # side by side: one at a time, alternating, --jobs 1 (the default)
    local round name target t0
    for round in 1 2; do
        for name in host host-async slow-async; do
            case $name in host) target=host ;; host-async) target=host-async ;; *) target=$slow ;; esac
            t0=$(date +%s%N)
            validate "timing-$name-$round" 150 "$target"
            echo "$name round $round $((($(date +%s%N) - t0) / 1000000)) ms" >>"$out/timing.txt"
        done
    done
    summarize
}
runs20() {      # NAME TARGET: 20 runs at the default seed, ten at once
    local batch i
    for batch in 0 1; do
        for i in $(seq 1 10); do
            validate "runs-$1-$((batch * 10 + i))" 270 "$2" --jobs 2 &
        done
        wait
        summarize
    done
}

case "$part" in
    1) tests; planted; timing ;;
    2) runs20 host host ;;
    3) runs20 example "$example" ;;
    *) echo "which part: 1, 2 or 3" >&2; exit 2 ;;
esac
cat "$out/steps.txt" "$out/validate-summary.txt" "$out/timing.txt" 2>/dev/null
exit 0
