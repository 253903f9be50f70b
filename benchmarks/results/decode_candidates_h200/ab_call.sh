#!/usr/bin/env bash
# one-off device call: input-transform A/B (branch vs main), ncu of the transforms, then run_h200.sh profile
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
o=/tmp/c2; mkdir -p $o
cp escha/kernels/transforms.py /tmp/transforms_branch.py
timeout 100 python benchmarks/bench_decode_wgmma.py --out $o/branch --ms 1,8,16,64 --rounds 5 --breakdown > $o/ab_branch.txt 2>&1
cp tmp_ab/transforms_main.py escha/kernels/transforms.py
timeout 100 python benchmarks/bench_decode_wgmma.py --out $o/main --ms 1,8,16,64 --rounds 5 --breakdown > $o/ab_main.txt 2>&1
cp /tmp/transforms_branch.py escha/kernels/transforms.py
for p in "gate_up 1" "down 1" "down 64"; do set -- $p
  timeout 60 ncu --clock-control none -k regex:transform --launch-skip 2 --launch-count 2 --section SpeedOfLight \
    --section WarpStateStats --section LaunchStats --section Occupancy --section SchedulerStats --section MemoryWorkloadAnalysis \
    python benchmarks/profile_decode.py --shape $1 --m $2 --calls 3 > $o/ncu_$1_$2.txt 2>&1
done
cat $o/ncu_*.txt > $o/ncu_transforms.txt
ESCHA_GIT_SHA=${ESCHA_GIT_SHA} benchmarks/run_h200.sh profile /tmp/prof
cp $o/ab_branch.txt $o/ab_main.txt $o/ncu_transforms.txt $OUT/; cp /tmp/prof.tgz $OUT/
grep -E "M=" $o/ab_*.txt | cut -c1-400
cat /tmp/prof/steps.log
