#!/usr/bin/env bash
# vLLM's nightly latency test replayed under kvtool's cost model: 8 requests of 32 prompt tokens,
# 128 generated each, all at once (latency-8x32x128.jsonl), llama-3.1-8b at TP 1 and llama-3.1-70b at
# TP 4 on an H200 and an H100. Run from the repository root.
set -eu
OUT=results/trace-cost-model-check
W=$OUT/latency-8x32x128.jsonl
for gpu in H200 H100; do
  kvtool trace run $W --model llama-3.1-8b --gpu $gpu --fidelity blocks --cost-model --output $OUT/$gpu-8b-tp1
  kvtool trace run $W --model llama-3.1-70b --tp 4 --gpu $gpu --fidelity blocks --cost-model --output $OUT/$gpu-70b-tp4
done > $OUT/run.txt
