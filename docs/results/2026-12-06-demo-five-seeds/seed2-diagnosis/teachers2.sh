#!/bin/bash
# seeds 0, 1 and 3's teachers, as the demo trains them (for the loop-to-loop KV probe)
export OMP_NUM_THREADS=1 PYTHONPATH=/work/s4
M=/work/main/.venv/bin/melt-eval; D=/tmp/exp2
t() { $M train --recipe pretrain-tiny --from tiny-random-ouro $([ $1 != 0 ] && echo --set seed=$1) --output $D/teacher$1 --no-progress > $D/teacher$1.train.log 2>&1; echo "teacher$1 rc=$? $(date +%T)" >> $D/times.log; }
t 0 & t 1; t 3; wait
echo "teachers done $(date +%T)" >> $D/times.log
