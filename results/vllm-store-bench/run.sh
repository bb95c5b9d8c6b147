#!/usr/bin/env bash
# `kvtool bench --suite store --compat vllm`: vLLM connectors through vLLM 0.32.0's scheduler (CPU
# pages), each beside kvtool's host connector through kvtool's engine in the same run.
# From the repository root, with the `vllm` extra installed: bash results/vllm-store-bench/run.sh
set -u
out=results/vllm-store-bench
for name in kvtool-host ExampleConnector DecodeBenchConnector; do
  /usr/bin/time -f "%e s wall" python -m kvtool bench --suite store --compat vllm --connector "$name" \
    --model llama-3.1-8b --quick --output "$out/$name" --format csv > "$out/$name.stdout.csv" 2> "$out/$name.stderr.txt"
  echo "$name: exit $?"
done
