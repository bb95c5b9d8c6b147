#!/usr/bin/env bash
# `kvtool trace run --compat vllm`: workloads/shared_prefix.jsonl (24 requests sharing prefixes) through
# vLLM 0.32.0's scheduler and a vLLM connector, beside kvtool's host connector through kvtool's engine
# in the same run; a 640-token pool (40 blocks of 16 tokens) so that the connector has work to do.
# From the repository root, with the `vllm` extra installed: bash results/vllm-trace/run.sh
set -u
out=results/vllm-trace
for name in kvtool-host ExampleConnector; do
  /usr/bin/time -f "%e s wall" python -m kvtool trace run workloads/shared_prefix.jsonl --compat vllm \
    --connector "$name" --tokens-per-block 16 --num-slots 40 --output "$out/$name" > "$out/$name.table.txt" \
    2> "$out/$name.stderr.txt"
  echo "$name: exit $?"
done
