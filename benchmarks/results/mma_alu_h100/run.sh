#!/usr/bin/env bash
# One device call: the synthetic MMA/integer overlap probe timed, then each form once under ncu
# (256-token build, 4 integer rounds a step). Writes under $OUT.
set -u
export PYTHONPATH=$PWD
python benchmarks/probe_mma_alu.py --out "$OUT/mma_alu" --steps 400 --rounds 7 --alu 1,2,3,4,6,8
M=gpu__time_duration.sum,sm__cycles_active.avg,smsp__issue_active.avg.pct_of_peak_sustained_active
M=$M,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active
M=$M,sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active
M=$M,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio
M=$M,smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_membar_per_issue_active.ratio
M=$M,smsp__average_warps_issue_stalled_not_selected_per_issue_active.ratio,smsp__average_warps_issue_stalled_gmma_per_issue_active.ratio
M=$M,smsp__average_warps_issue_stalled_dispatch_stall_per_issue_active.ratio,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio
for f in alu mma both both_sync both_fence; do
  ncu --metrics "$M" --kernel-name regex:_probe_kernel python benchmarks/probe_mma_alu.py --out "$OUT/mma_alu" --steps 400 \
    --launch b256:$f:4 > "$OUT/mma_alu/ncu_b256_${f}_alu4.txt" 2>&1
done
