#!/usr/bin/env bash
# A capacity study for a host KV tier under llama-3.1-70b on four H200s (TP 4): a chat workload
# generated here (the same seed and knobs give the same file; 96 MB, not committed), the sweep with
# its recommendation and figure, then the fleet (four engines) with private tiers at the knee (both
# routings), one pooled tier of the four together, and a quarter of the knee on each host stacked
# over that pooled tier. Run from the repository root: bash results/trace-capacity-study/run.sh
set -u
OUT=${OUT:-results/trace-capacity-study}
REQUESTS=${REQUESTS:-3000}
W=${W:-/tmp/kvtool-study-chat-$REQUESTS.jsonl}
M="--fidelity blocks --cost-model --model llama-3.1-70b --tp 4 --gpu H200"
kvtool trace generate chat --requests "$REQUESTS" --seed 55 --turn-tokens 512 --turns 8 --rate 0.5 \
    --think-seconds 120 --output "$W" > "$OUT/generate.txt" 2>&1
kvtool trace sweep "$W" $M --capacity 16GiB,32GiB,64GiB,128GiB,256GiB,512GiB --baseline --ttft-slo 0.2 \
    --price-per-gib 4 --jobs 2 --output "$OUT/sweep" > "$OUT/sweep.txt" 2>&1
# The sweep's recommendation (a GPU's tier: its shard of each block, in MiB), and the same host memory
# in all for the fleet: 4 engines x 4 GPUs x KNEE pooled (a shared store holds whole blocks), or a
# quarter of it on each GPU stacked over a pooled remote of the other three quarters.
KNEE=$(python -c "import json; print(json.load(open('$OUT/sweep/sweep.json'))['study']['tokens_per_block']['32']['knee']['capacity_bytes'] // 2**20)")
POOLED=$(( KNEE * 16 ))MiB
echo "knee ${KNEE}MiB a GPU; pooled $POOLED; stacked $(( KNEE / 4 ))MiB a GPU over $(( KNEE * 12 ))MiB" > "$OUT/fleet.txt"
port=$(python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
redis-server --bind 127.0.0.1 --port "$port" --save '' --appendonly no --protected-mode yes > /dev/null & pid=$!
for _ in $(seq 100); do redis-cli -p "$port" ping > /dev/null 2>&1 && break; sleep 0.05; done
R="--connector-opt url=redis://127.0.0.1:$port/0"
for route in round-robin prefix; do
  kvtool trace run "$W" $M --instances 4 --route $route --connector index --connector-opt capacity=${KNEE}MiB \
      --output "$OUT/fleet-private-$route" > "$OUT/fleet-private-$route.txt" 2>&1
done
kvtool trace run "$W" $M --instances 4 --connector redis-index $R --connector-opt prefix=pooled \
    --connector-opt capacity=$POOLED --output "$OUT/fleet-pooled" > "$OUT/fleet-pooled.txt" 2>&1
kvtool trace run "$W" $M --instances 4 --connector stacked-index $R --connector-opt prefix=stacked \
    --connector-opt capacity=$(( KNEE / 4 ))MiB --connector-opt remote_capacity=$(( KNEE * 12 ))MiB \
    --output "$OUT/fleet-stacked" > "$OUT/fleet-stacked.txt" 2>&1
kill "$pid"; wait "$pid" 2>/dev/null
