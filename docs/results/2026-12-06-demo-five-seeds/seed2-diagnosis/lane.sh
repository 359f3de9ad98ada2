#!/bin/bash
# lane.sh NAME TEACHER_ARGS... : one teacher at seed 2, then phase 1 (80 and 160 steps) from it, each evaluated as the demo does
export OMP_NUM_THREADS=1 PYTHONPATH=/work/s4
M=/work/main/.venv/bin/melt-eval
D=/tmp/exp2; n=$1; shift
ev() { $M run synthetic --model $1 --max-problems 100 --samples 16 --seed 2 --prefill-chunk 112 --output $D/results --name $2 --no-progress > $D/$2.eval.log 2>&1; echo "$2 eval rc=$? $(date +%T)" >> $D/times.log; }
echo "$n start $(date +%T) $(uptime)" >> $D/times.log
$M train --recipe pretrain-tiny --from tiny-random-ouro --set seed=2 "$@" --output $D/$n --no-progress > $D/$n.train.log 2>&1
echo "$n teacher rc=$? $(date +%T)" >> $D/times.log
ev $D/$n $n
for s in 80 160; do
  $M train --recipe tiny-phase1 --from $D/$n --set seed=2 --set gate_seed=2 --max-steps $s --output $D/$n-p1-$s --no-progress > $D/$n-p1-$s.train.log 2>&1
  echo "$n-p1-$s rc=$? $(date +%T)" >> $D/times.log
  ev $D/$n-p1-$s $n-p1-$s
done
echo "$n done $(date +%T) $(uptime)" >> $D/times.log
