#!/usr/bin/env bash
# NVIDIA Dynamo KVBM 1.6.1's and LMCache 0.5.6's TensorRT-LLM connectors under `kvtool validate
# --compat trtllm` on GPU pages: the run a CPU-only machine cannot make (docs/field-connectors.md
# says what stops it there).
#
# 1. Where the package index is reachable: bash field-kits/field-kit.sh kvbm; bash field-kits/field-kit.sh lmcache-gpu
#    -> .field/kit-kvbm.tar.xz, .field/kit-lmcache-gpu.tar.xz (LMCache less what the GPU image holds)
# 2. Through the device tool, carrying both kits (and .whl, the device wheels), one call:
#      export KVTOOL_COMMIT=<HEAD here>; bash field-kits/field-gpu.sh
#    within DEADLINE_S (560 s) of its start; without LMCache's kit only KVBM runs. Results: $OUT/field-gpu.tgz (every run folder: results.json,
#    results.csv, meta.json, tracebacks/; each step's log), and beside it steps.txt (one line a step:
#    rc and seconds) and summary.csv (every verdict row, with the run it came from).
# First a probe (field-kits/field-kvbm-probe.py) builds KVBM alone and times it; should it hang, its stack is
# logged and only one batch runs (60 s). The validate runs are batches of scenarios, each its own folder, so a batch cut by the deadline
# loses only itself; each batch gets its own KVBM ZMQ ports, and inside a batch each scenario's
# process starts once the one before it has ended (--no-overlap: KVBM's leader holds its ports until
# its process exits). LMCache's in-process adapter runs on a Hugging Face config of `tiny`'s shape (it reads the
# model with transformers, offline), its multi-process adapter against its own server, started here
# on a free port and stopped by pid (its log kept). FIELD_DEVICE=cpu runs the same steps on CPU pages (a check of this script's plumbing only:
# there KVBM's worker cannot be built). Exit 2: no GPU, or no kit; else 0 (the verdicts are in
# summary.csv, each step's rc in steps.txt).
set -uo pipefail
device=${FIELD_DEVICE:-cuda}
kit=${FIELD_KIT:-.field/kit-kvbm.tar.xz}
[ -n "${OUT:-}" ] || { echo "field-gpu: OUT is not set: run it through the device tool, which sets it" >&2; exit 2; }
work=/tmp/field-gpu && rm -rf "$work" && mkdir -p "$work"
deadline=$(($(date +%s) + ${DEADLINE_S:-560}))
note() { echo "$*" | tee -a "$work/steps.txt" >&2; }
pack() {
    tar czf "$OUT/field-gpu.tgz" -C /tmp field-gpu
    local small; for small in steps.txt summary.csv errors.txt; do [ -f "$work/$small" ] && cp "$work/$small" "$OUT/"; done
    return 0
}
step() {   # NAME SECONDS COMMAND...: run within min(SECONDS, what is left before the deadline), log it, pack
    local name=$1 limit=$2 t0 left rc; shift 2; t0=$(date +%s); left=$((deadline - t0 - 5))
    if [ "$left" -lt 15 ]; then note "$name not run: deadline"; return 1; fi
    timeout -k 5 "$((limit < left ? limit : left))" "$@" >"$work/$name.log" 2>&1; rc=$?
    note "$name rc=$rc $(($(date +%s) - t0))s$([ $rc = 124 ] && echo ' (cut by its time limit)')"
    pack; return $rc
}
summarize() {   # every verdict row of every run folder, prefixed by the run's name (the header: results.csv's)
    local csv header=""
    for csv in "$work"/runs/*/results.csv; do [ -f "$csv" ] && header=$(head -1 "$csv") && break; done
    echo "run,${header:-scenario,model,check,verdict,seconds,evidence,runtime,purpose,seed}" >"$work/summary.csv"
    for csv in "$work"/runs/*/results.csv; do
        [ -f "$csv" ] && tail -n +2 "$csv" | sed "s|^|$(basename "$(dirname "$csv")"),|" >>"$work/summary.csv"
    done
}

note "field-gpu: device=$device kit=$kit deadline ${DEADLINE_S:-560}s, started $(date -u +%FT%TZ)"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >"$work/nvidia-smi.csv" 2>&1
echo "${KVTOOL_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}" >"$work/commit.txt"
if [ "$device" = cuda ] && ! python3 -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    note "field-gpu: no CUDA GPU here (torch.cuda.is_available() is False); KVBM's worker needs one. Nothing run."
    pack; exit 2
fi
if [ ! -f "$kit" ]; then
    note "field-gpu: no kit at $kit: build it with field-kits/field-kit.sh kvbm and carry .field. Nothing run."
    pack; exit 2
fi
site=/tmp/field-gpu-kit && rm -rf "$site" && mkdir -p "$site" && tar -C "$site" -xJf "$kit" || { note "field-gpu: cannot unpack $kit"; pack; exit 2; }
export PYTHONPATH="$site/site:${PYTHONPATH:-$PWD}" KVTOOL_COMMIT="$(cat "$work/commit.txt")"
du -sb "$site/site" >"$work/kit-size.txt"   # unpacked outside $work: never packed back

step kvbm-import 45 python3 -c "
import sys, torch, nixl, kvbm, kvbm._core
print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)
print('kvbm', kvbm.__file__, 'nixl', nixl.__file__)
print('gpu', torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)"

# G2 (host memory) must be given a size, or the leader panics at construction ("At least one cache
# tier must be configured"); the KV-event consolidator wants TensorRT-LLM's own event publisher.
export DYN_KVBM_CPU_CACHE_GB=1 DYN_KVBM_KV_EVENTS_ENABLE_CONSOLIDATOR=false RUST_BACKTRACE=1 NO_COLOR=1
export DYN_KVBM_LEADER_ZMQ_PUB_PORT=56091 DYN_KVBM_LEADER_ZMQ_ACK_PORT=56092
step kvbm-probe 60 python3 field-kits/field-kvbm-probe.py "$device"   # construction + registration alone, timed
hung=0; grep -q "^Timeout (" "$work/kvbm-probe.log" && hung=1   # faulthandler's stack dump: a hang

kvbm=kvbm.trtllm_integration.connector:DynamoKVBMConnectorLeader:DynamoKVBMConnectorWorker
lmc=lmcache.integration.tensorrt_llm.tensorrt_adapter:LMCacheKvConnectorScheduler:LMCacheKvConnectorWorker
lmc_mp=lmcache.integration.tensorrt_llm.tensorrt_mp_adapter:LMCacheMPKvConnectorScheduler:LMCacheMPKvConnectorWorker
port=56101
only=${FIELD_ONLY:-.}   # a regular expression: only the validate batches whose names match run
kvbm_warmup=${KVBM_WARMUP:-1}
validate() {   # NAME SECONDS TARGET ARGS...: one validate run of TARGET into runs/NAME
    [[ "$1" =~ $only ]] || return 0
    export DYN_KVBM_LEADER_ZMQ_PUB_PORT=$port DYN_KVBM_LEADER_ZMQ_ACK_PORT=$((port + 1)); port=$((port + 10))
    step "$1" "$2" python3 -m kvtool validate "$3" --compat trtllm --device "$device" --jobs 1 --no-overlap \
        --timeout 30 --load-timeout 15 --save-timeout 15 --format csv --output "$work/runs/$1" "${@:4}"
    [ -f "$work/runs/$1/results.csv" ] ||   # no run folder: validate stopped before a scenario (exit 2)
        echo "$1: $(grep -a 'kvtool: error' "$work/$1.log" | tail -1)" >>"$work/errors.txt"
    summarize; pack
}
scenarios() { local s; for s in "$@"; do printf -- '--scenario %s ' "$s"; done; }

# LMCache: its kit unpacked beside KVBM's (whose pydantic it shares), a Llama config of tiny's shape.
lmc_kit=${FIELD_LMCACHE_KIT:-.field/kit-lmcache-gpu.tar.xz}
lmcache=0
if [ -f "$lmc_kit" ]; then
    lmc_site=/tmp/field-gpu-lmc && rm -rf "$lmc_site" && mkdir -p "$lmc_site" && tar -C "$lmc_site" -xJf "$lmc_kit" && lmcache=1
    hf="$work/hf/tiny-llama" && mkdir -p "$hf"
    printf '{"_name_or_path": "%s", "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 4, "intermediate_size": 64, "max_position_embeddings": 4096, "torch_dtype": "bfloat16", "vocab_size": 32000}\n' "$hf" >"$hf/config.json"
fi
lmc_env=(env PYTHONPATH="${lmc_site:-}/site:$PYTHONPATH" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 LMCACHE_CHUNK_SIZE=32
         LMCACHE_LOCAL_CPU=True LMCACHE_MAX_LOCAL_CPU_SIZE=1)
lmc_validate() {   # NAME SECONDS TARGET ARGS...: validate with LMCache's environment, on the Llama config
    ( export "${lmc_env[@]:1}"; validate "$1" "$2" "$3" --model "$hf/config.json" --tokens-per-block 32 "${@:4}" )
}
if [ "$lmcache" = 1 ]; then
    step lmcache-import 60 "${lmc_env[@]}" python3 -c "
import sys, torch, lmcache
from kvtool.connector.compat import install_compat
install_compat('trtllm')   # the TensorRT-LLM modules the adapters import, as validate --compat trtllm gives them
print('lmcache', lmcache.__file__)
import lmcache.integration.tensorrt_llm.tensorrt_adapter as a
print('in-process adapter', a.__file__)
import lmcache.integration.tensorrt_llm.tensorrt_mp_adapter as m
print('multi-process adapter', m.__file__)"
fi
mp_pid=""
lmc_server() {   # start LMCache's multi-process server in its own session on a free port: sets mp_port, mp_pid
    mp_port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    setsid "${lmc_env[@]}" python3 -m lmcache.v1.multiprocess.server --host 127.0.0.1 --port "$mp_port" \
        --l1-size-gb 1 --eviction-policy LRU --max-workers 1 >"$work/lmc-server.log" 2>&1 &
    mp_pid=$!
    local _; for _ in $(seq 60); do   # up to 30 s for it to listen
        python3 -c "import socket, sys; socket.create_connection(('127.0.0.1', $mp_port), 0.5)" 2>/dev/null && return 0
        sleep 0.5
    done
    note "lmc-server: not listening on $mp_port after 30 s"
}
lmc_server_stop() {   # its whole process group, then a kill after 10 s
    [ -n "$mp_pid" ] || return 0
    kill -- -"$mp_pid" 2>/dev/null
    local _; for _ in $(seq 20); do kill -0 "$mp_pid" 2>/dev/null || break; sleep 0.5; done
    kill -9 -- -"$mp_pid" 2>/dev/null; wait "$mp_pid" 2>/dev/null; mp_pid=""
}
trap lmc_server_stop EXIT

# KVBM's leader builds its slot manager in the background about 50 ms after its worker registered
# and panics on an ask before ("slot_manager not initialized"); TensorRT-LLM warms up before it
# serves, so KVBM runs with --warmup (KVBM_WARMUP seconds; 0 shows the race).
# Each connector on the runtime it targets: KVBM 1.6.1 is a V1 connector (one pool tensor, flat
# hooks, block hashes), LMCache 0.5.6's adapters run on V1 and main's V2. TensorRT-LLM's usual 32
# tokens a block, the flat (one layer group) model; the most telling scenarios first, so that what
# the deadline cuts is the least. FIELD_ONLY picks batches (two calls of the device tool fit them all).
# shellcheck disable=SC2046
{
first="cold-warm async-save async-load contract multi-turn"
kvbm_args=(--model tiny --tokens-per-block 32 --warmup "$kvbm_warmup")
validate kvbm-v1-a $((hung ? 60 : 150)) "$kvbm" --runtime trtllm-v1 "${kvbm_args[@]}" $(scenarios $first)
[ "$lmcache" = 1 ] && lmc_validate lmc-v1-a 120 "$lmc" --runtime trtllm-v1 $(scenarios $first)
[ "$lmcache" = 1 ] && lmc_validate lmc-v2-a 120 "$lmc" --runtime trtllm-v2 $(scenarios $first)
[ "$hung" = 0 ] && validate kvbm-v1-b 120 "$kvbm" --runtime trtllm-v1 "${kvbm_args[@]}" \
    $(scenarios chunked-prefill deferral clamp local-prefix moved-blocks)
[ "$lmcache" = 1 ] && lmc_validate lmc-v1-b 150 "$lmc" --runtime trtllm-v1 \
    $(scenarios chunked-prefill deferral clamp local-prefix final-pass-blocks)
[ "$lmcache" = 1 ] && lmc_validate lmc-v2-b 150 "$lmc" --runtime trtllm-v2 \
    $(scenarios chunked-prefill deferral reserve-failure clamp pause-replay)
if [ "$lmcache" = 1 ] && [[ lmc-mp-v1 =~ $only ]]; then   # V1 hands its pool as one tensor, not a list
    lmc_server
    lmc_validate lmc-mp-v1 90 "$lmc_mp" --runtime trtllm-v1 --connector-opt "server_url=tcp://127.0.0.1:$mp_port" \
        $(scenarios cold-warm multi-turn contract)
    lmc_server_stop
fi
[ "$hung" = 0 ] && validate kvbm-v1-c 100 "$kvbm" --runtime trtllm-v1 "${kvbm_args[@]}" \
    $(scenarios final-pass-blocks hook-raises cache-salt concurrency draft-tokens)
# KVBM off its runtime: on main's V2 it asserts block hashes, which V2 does not report.
[ "$hung" = 0 ] && validate kvbm-v2-a 60 "$kvbm" --runtime trtllm-v2 "${kvbm_args[@]}" $(scenarios cold-warm contract)
[ "$lmcache" = 1 ] && lmc_validate lmc-v2-c 120 "$lmc" --runtime trtllm-v2 \
    $(scenarios local-prefix final-pass-blocks concurrency cache-salt hook-raises)
# Several layer groups: V1 refuses VSWA; on V2 KVBM has only the flat hooks, which V2 refuses too.
validate kvbm-vswa-refused 40 "$kvbm" --model tiny-vswa --tokens-per-block 32 $(scenarios cold-warm)
}
note "field-gpu: done $(date -u +%FT%TZ)"
pack
exit 0
