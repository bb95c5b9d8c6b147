#!/usr/bin/env bash
# The store bench for results/store-bench/: host, disk, redis (loopback), mooncake (private netns).
set -u
cd /tmp/runclone
source /work/venv/bin/activate; export PYTHONPATH=/tmp/runclone
OUT=results/store-bench
rm -rf $OUT; mkdir -p $OUT
for c in host disk; do
  python -m kvtool bench --suite store --connector $c --output $OUT/$c > $OUT/$c.txt 2>&1
done
port=$(python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
redis-server --bind 127.0.0.1 --port $port --save '' --appendonly no --protected-mode yes > /dev/null & pid=$!
sleep 0.5
python -m kvtool bench --suite store --connector redis --connector-opt url=redis://127.0.0.1:$port/0 --output $OUT/redis > $OUT/redis.txt 2>&1
kill $pid
unshare -n -- sh -c "ip link set lo up && python - <<'PY'
import subprocess, sys
from tests.helpers.servers import MooncakeStore
s = MooncakeStore(segment='4GB').start()
try:
    args = [a for k, v in s.options.items() for a in ('--connector-opt', f'{k}={v}')]
    with open('$OUT/mooncake.txt', 'w') as out:
        subprocess.run([sys.executable, '-m', 'kvtool', 'bench', '--suite', 'store', '--connector', 'mooncake',
                        '--output', '$OUT/mooncake', *args], stdout=out, stderr=subprocess.DEVNULL)
finally:
    s.stop()
PY"
echo done > /tmp/sb.done
