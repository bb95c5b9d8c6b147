#!/usr/bin/env bash
# Mooncake FAST'25 Fig. 10 at equal total capacity: four engines, each with a private tier of
# TOTAL / 4, against the same four sharing one pooled tier of TOTAL (a bounded Redis), on the
# whole conversation trace (prefill only, blocks fidelity, llama-3.1-8b on H200s, round-robin).
# Run from the repository root: bash results/trace-fig10-pooled-vs-private/run.sh TRACE
set -u
T=${1:-../shared/traces/mooncake_conversation_trace.jsonl}
OUT=results/trace-fig10-pooled-vs-private
for total in 128GiB:32GiB 512GiB:128GiB 2TiB:512GiB 8TiB:2TiB; do
  pooled=${total%%:*}; private=${total##*:}
  python -m kvtool trace run "$T" --prefill-only --instances 4 --connector index \
      --connector-opt capacity=$private --output $OUT/private-$pooled > $OUT/private-$pooled.txt 2>&1
  port=$(python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  redis-server --bind 127.0.0.1 --port "$port" --save '' --appendonly no --protected-mode yes > /dev/null & pid=$!
  for _ in $(seq 100); do redis-cli -p "$port" ping > /dev/null 2>&1 && break; sleep 0.05; done
  python -m kvtool trace run "$T" --prefill-only --instances 4 --connector redis-index \
      --connector-opt url=redis://127.0.0.1:$port/0 --connector-opt capacity=$pooled \
      --output $OUT/pooled-$pooled > $OUT/pooled-$pooled.txt 2>&1
  echo "keys: $(redis-cli -p "$port" dbsize); $(redis-cli -p "$port" info memory | grep used_memory_human)" >> $OUT/pooled-$pooled.txt
  kill "$pid"; wait "$pid" 2>/dev/null
done
