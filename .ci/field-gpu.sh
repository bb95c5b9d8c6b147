#!/usr/bin/env bash
# The field's TensorRT-LLM connectors on GPU pages: NVIDIA Dynamo KVBM 1.6.1 (and LMCache 0.5.6's
# in-process adapter, when its kit was carried too). Neither can run on a CPU-only machine
# (docs/field-connectors.md says what stops each there); this is the run the GPU machine can make.
#
# 1. Where the package index is reachable (any CPU machine): bash .ci/field-kit.sh kvbm
#    -> .field/kit-kvbm.tar.xz (25.6 MiB; the wheels themselves are 78 MiB and do not fit the carry).
# 2. Through the device tool, carrying .field, in one call (about 6 minutes at most):
#      export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 && bash .ci/field-gpu.sh
#    Everything lands in $OUT/field-gpu.tgz: one folder per validate run (results.json, results.csv,
#    meta.json, tracebacks/), its log, steps.txt (one line per run: rc and seconds), nvidia-smi.csv.
# The KVBM leader binds ZMQ ports 56001 and 56002 on 127.0.0.1 (its defaults) in each scenario's
# process, so the scenarios run one after another (--jobs 1).
set -uo pipefail
out="${OUT:?run through the device tool, which sets OUT}/field-gpu"
mkdir -p "$out"
deadline=$(($(date +%s) + ${DEADLINE_S:-560}))
pack() { tar czf "$OUT/field-gpu.tgz" -C "$OUT" field-gpu; }
step() {   # NAME SECONDS COMMAND...: run within min(SECONDS, what is left), log it, pack
    local name=$1 limit=$2 t0 left; shift 2; t0=$(date +%s); left=$((deadline - t0))
    if [ "$left" -lt 20 ]; then echo "$name not run: deadline" >>"$out/steps.txt"; return; fi
    timeout "$((limit < left ? limit : left))" "$@" >"$out/$name.log" 2>&1
    echo "$name rc=$? $(($(date +%s) - t0))s" >>"$out/steps.txt"
    pack
}
nvidia-smi --query-gpu=name,driver_version --format=csv >"$out/nvidia-smi.csv" 2>&1
git rev-parse HEAD >"$out/commit.txt" 2>/dev/null || echo "${KVTOOL_COMMIT:-unknown}" >"$out/commit.txt"

unpack() {   # WHAT: .field/kit-WHAT.tar.xz -> /tmp/field-WHAT/site, put first on PYTHONPATH
    mkdir -p "/tmp/field-$1" && tar -C "/tmp/field-$1" -xJf ".field/kit-$1.tar.xz" || return 1
    export PYTHONPATH="/tmp/field-$1/site:${PYTHONPATH:-$PWD}"
}
validate() {   # NAME TARGET ARGS...: one validate run on device pages
    step "$1" 170 python3 -m kvtool validate "$2" --compat trtllm --device cuda --jobs 1 --timeout 60 \
        --load-timeout 20 --save-timeout 20 --format csv --output "$out/$1" "${@:3}"
}

kvbm=kvbm.trtllm_integration.connector:DynamoKVBMConnectorLeader:DynamoKVBMConnectorWorker
if unpack kvbm; then
    step kvbm-import 60 python3 -c "import kvbm, nixl, torch; print(kvbm.__file__, nixl.__file__, torch.__version__)"
    # G2 (host memory) must be given a size, or the leader panics at construction; the event
    # consolidator needs a port of TensorRT-LLM's own KV-event publisher, which kvtool has not.
    export DYN_KVBM_CPU_CACHE_GB=1 DYN_KVBM_KV_EVENTS_ENABLE_CONSOLIDATOR=false RUST_BACKTRACE=0
    validate kvbm-tiny-tpb32 "$kvbm" --model tiny --tokens-per-block 32    # TensorRT-LLM's usual block
    validate kvbm-default "$kvbm"                                           # tiny and tiny-vswa, 4 tokens a block
    unset DYN_KVBM_CPU_CACHE_GB DYN_KVBM_KV_EVENTS_ENABLE_CONSOLIDATOR
else
    echo "kvbm kit missing: run .ci/field-kit.sh kvbm and carry .field" >>"$out/steps.txt"
fi

lmcache=lmcache.integration.tensorrt_llm.tensorrt_adapter:LMCacheKvConnectorScheduler:LMCacheKvConnectorWorker
if [ -f .field/kit-lmcache.tar.xz ] && unpack lmcache; then
    # The adapter reads the model through transformers' AutoConfig.from_pretrained(llm_args.model):
    # kvtool's llm_args.model is the config's _name_or_path, so point it at the config's own folder.
    hf=/tmp/field-lmcache/hf/tiny-llama && mkdir -p "$hf"
    printf '{"_name_or_path": "%s", "model_type": "llama", "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "hidden_size": 64, "intermediate_size": 128, "vocab_size": 32000, "torch_dtype": "bfloat16"}\n' "$hf" >"$hf/config.json"
    export HF_HUB_OFFLINE=1 LMCACHE_CHUNK_SIZE=32 LMCACHE_LOCAL_CPU=True LMCACHE_MAX_LOCAL_CPU_SIZE=1
    validate lmcache-tpb32 "$lmcache" --model "$hf/config.json" --tokens-per-block 32
fi
pack
