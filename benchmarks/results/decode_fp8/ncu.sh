#!/usr/bin/env bash
# ncu of the fp8 decode GEMM beside the fp16 one (gate_up, 64 tokens; plain launches for the fp8
# kernel, the rule's for the fp16 one): issue slots, pipes, stall reasons per issued instruction.
# Usage (repository root, on the GPU): benchmarks/results/decode_fp8/ncu.sh OUT_DIR
set -uo pipefail
o=${1:?output folder}; mkdir -p "$o"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
for p in fp8 wgmma; do
  k=$([ $p = fp8 ] && echo _decode_fp8_kernel || echo _decode_wgmma_kernel)
  timeout 150 ncu --clock-control none -k regex:$k --launch-skip 6 --launch-count 1 --set full \
    --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,regex:sm__inst_executed_pipe_.*\.sum,regex:smsp__inst_executed_op_.*\.sum' \
    python benchmarks/profile_decode.py --path $p --shape gate_up --m 64 --calls 8 > "$o/ncu_gate_up_m64_$p.txt" 2>&1
  echo "$p rc=$?"
done
