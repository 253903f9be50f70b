#!/usr/bin/env bash
# The second device call: both integer mixes, the warp-specialized forms (256-token build), then
# four forms once each under ncu (256-token build, 4 rounds). Writes under $OUT.
set -u
export PYTHONPATH=$PWD
python benchmarks/probe_mma_alu.py --out "$OUT/mma_alu2" --steps 400 --rounds 7 --alu 1,2,4,8 --mixes alu,fma
M=gpu__time_duration.sum,sm__cycles_active.avg,smsp__issue_active.avg.pct_of_peak_sustained_active
M=$M,sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active
M=$M,sm__inst_executed_pipe_fmaheavy.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_tensor_op_gmma.sum
M=$M,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio
M=$M,smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_dispatch_stall_per_issue_active.ratio
M=$M,smsp__average_warps_issue_stalled_not_selected_per_issue_active.ratio,smsp__average_warps_issue_stalled_gmma_per_issue_active.ratio
for spec in ws:4:alu ws_mma:4:alu both:4:fma alu:4:fma mma:4:alu; do
  IFS=: read -r f a mix <<< "$spec"
  ncu --metrics "$M" --kernel-name regex:_probe_kernel\|_ws_kernel python benchmarks/probe_mma_alu.py --out "$OUT/mma_alu2" \
    --steps 400 --launch b256:$f:$a:$mix > "$OUT/mma_alu2/ncu_b256_${f}_${mix}${a}.txt" 2>&1
done
