#!/bin/bash
# loop worker: rounds given as args (e.g. "2 4 6 8 10"); skips "R file rc=" lines already in results;
# a file never runs in two workers at once (flock per file: namespaces, fixed names)
cd /work/wt/loop
FILES=$(grep -lE "run_distributed|subprocess|torchrun|spawn|start_python|run_python|run_cli|served_python" -r tests --include=test_*.py | grep -v gpu/ | sort)
W=$$
for r in "$@"; do
for f in $FILES; do
  [ -f /tmp/loop_stop ] && exit 0
  if grep -q "^$r $f rc=" /tmp/loop_results.txt; then continue; fi
  if grep -q "^[0-9]* $f rc=5 " /tmp/loop_results.txt; then continue; fi
  s=$(date +%s)
  flock /tmp/looplock_$(echo $f | tr / _) env PYTHONPATH=/work/wt/loop nice -n 15 timeout 900 /work/main/.venv/bin/python -m pytest -q -m "not slow" -p no:cacheprovider -p no:randomly "$f" > /tmp/loop_out_$W.txt 2>&1
  rc=$?
  e=$(( $(date +%s) - s ))
  echo "$r $f rc=$rc ${e}s $(tail -1 /tmp/loop_out_$W.txt)" >> /tmp/loop_results.txt
  if [ $rc -ne 0 ] && [ $rc -ne 5 ]; then cp /tmp/loop_out_$W.txt /tmp/loop_fail_${r}_$(basename $f).txt; fi
done
echo "ROUND $r DONE $(date)" >> /tmp/loop_results.txt
done
