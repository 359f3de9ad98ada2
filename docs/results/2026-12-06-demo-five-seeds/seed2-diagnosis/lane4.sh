#!/bin/bash
# the swap: phase 1 at seed 2's data order and gate initialisation from seed 4's teacher
export OMP_NUM_THREADS=1 PYTHONPATH=/work/s4
M=/work/main/.venv/bin/melt-eval; D=/tmp/exp2; n=t4-p1-80-s2
$M train --recipe tiny-phase1 --from /tmp/seeds/seed4/runs/pretrain-tiny-seed=4-c5059df5 --set seed=2 --set gate_seed=2 --output $D/$n --no-progress > $D/$n.train.log 2>&1
echo "$n rc=$? $(date +%T)" >> $D/times.log
$M run synthetic --model $D/$n --max-problems 100 --samples 16 --seed 4 --prefill-chunk 112 --output $D/results --name $n --no-progress > $D/$n.eval.log 2>&1; echo "$n eval rc=$? $(date +%T)" >> $D/times.log
