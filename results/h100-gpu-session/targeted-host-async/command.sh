set -uo pipefail
o=$OUT/last; mkdir -p $o
pack() { tar czf $OUT/last.tgz -C $OUT last; }
nvidia-smi --query-gpu=name,driver_version --format=csv > $o/nvidia-smi.csv
t0=$(date +%s)
timeout 100 python3 -m pytest -q -o addopts="" -p no:cacheprovider tests/gpu/test_bench_gpu.py "tests/gpu/test_backends.py::test_a_save_from_a_worker_thread_works_frees_in_context_and_the_process_exits_cleanly" --junitxml=$o/tests.xml > $o/tests.log 2>&1
echo "tests rc=$? $(($(date +%s)-t0))s" >> $o/steps.txt; pack
pids=""
for i in $(seq 1 10); do
  (s=$(date +%s); timeout 110 python3 -m kvtool validate host-async --device cuda --jobs 2 --scenario local-prefix --scenario async-save --scenario final-pass-blocks --output $o/ha$i --format csv > $o/ha$i.log 2>&1; echo "ha$i rc=$? $(($(date +%s)-s))s" >> $o/steps.txt) &
  pids="$pids $!"
done
wait $pids; pack
grep -h "checks:" $o/ha*.log | sort | uniq -c > $o/summary.txt; grep -c "out-of-thread" $o/*.log >> $o/summary.txt
pack; cat $o/steps.txt $o/summary.txt
