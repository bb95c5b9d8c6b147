#!/usr/bin/env bash
# Local-versus-global on the Mooncake conversation trace (block fidelity, 4 instances), then the
# store bench; both from the clean clone /tmp/runclone, results copied into the repository later.
set -u
source /work/venv/bin/activate
cd /tmp/runclone
export PYTHONPATH=/tmp/runclone
T=/work/shared/traces/mooncake_conversation_trace.jsonl
OUT=results/trace-local-vs-global
rm -rf $OUT; mkdir -p $OUT
for route in round-robin prefix; do
  port=$(python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  redis-server --bind 127.0.0.1 --port $port --save '' --appendonly no --protected-mode yes > /dev/null & pid=$!
  sleep 0.5
  /usr/bin/time -v python -m kvtool trace run $T --prefill-only --instances 4 --route $route --connector redis-index \
      --connector-opt url=redis://127.0.0.1:$port/0 --output $OUT/global-$route > $OUT/global-$route.txt 2> /tmp/lvg/global-$route.err
  redis-cli -p $port info memory | grep -E "used_memory_human|used_memory_peak_human" >> $OUT/global-$route.txt
  echo "keys: $(redis-cli -p $port dbsize)" >> $OUT/global-$route.txt
  kill $pid
  /usr/bin/time -v python -m kvtool trace run $T --prefill-only --instances 4 --route $route --connector index \
      --connector-opt capacity=1e9 --output $OUT/local-$route > $OUT/local-$route.txt 2> /tmp/lvg/local-$route.err
done
python -m kvtool trace run $T --prefill-only --connector index --connector-opt capacity=1e9 --output $OUT/one-instance > $OUT/one-instance.txt 2> /tmp/lvg/one.err
echo lvg-done > /tmp/lvg/finished
sed -i 's#^cd /work/main#cd /tmp/runclone#; s#^source /work/venv/bin/activate#source /work/venv/bin/activate; export PYTHONPATH=/tmp/runclone#' /tmp/sb.sh
bash /tmp/sb.sh
echo all-done >> /tmp/lvg/finished
