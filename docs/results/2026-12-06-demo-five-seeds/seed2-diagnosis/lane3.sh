#!/bin/bash
# after the two lanes: phase 1 (80 steps) from the seed-2 teacher at other data orders and gate initialisations
export OMP_NUM_THREADS=1 PYTHONPATH=/work/s4
M=/work/main/.venv/bin/melt-eval; D=/tmp/exp2
while [ $(grep -c " done " $D/times.log) -lt 1 ]; do sleep 5; done
ev() { $M run synthetic --model $1 --max-problems 100 --samples 16 --seed 2 --prefill-chunk 112 --output $D/results --name $2 --no-progress > $D/$2.eval.log 2>&1; echo "$2 eval rc=$? $(date +%T)" >> $D/times.log; }
for s in 0 7; do
  n=t750-p1-80-s$s
  $M train --recipe tiny-phase1 --from $D/t750 --set seed=$s --set gate_seed=$s --output $D/$n --no-progress > $D/$n.train.log 2>&1
  echo "$n rc=$? $(date +%T)" >> $D/times.log; ev $D/$n $n
done
echo "lane3 done $(date +%T)" >> $D/times.log
