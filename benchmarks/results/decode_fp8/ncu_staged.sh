#!/usr/bin/env bash
# ncu of decode_fp8's staged GEMM builds at gate_up, 256 tokens (plain launches): the summary
# (issue slots, pipes, stall reasons per issued instruction) and the per-instruction SASS view
# (warp-state samples by instruction) of each. Usage (repository root, on the GPU):
#   benchmarks/results/decode_fp8/ncu_staged.sh OUT_DIR [CONFIG ...]   (CONFIG: profile_decode.py --staged)
set -uo pipefail
o=${1:?output folder}; shift; mkdir -p "$o"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
for c in "${@:-256,2,4,1,2}"; do
  n=${c//,/_}
  timeout 150 ncu --clock-control none -k regex:_decode_fp8_staged_kernel --launch-skip 6 --launch-count 1 --set full \
    --import-source no -o "$o/rep_$n" \
    --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,regex:sm__inst_executed_pipe_.*\.sum' \
    python benchmarks/profile_decode.py --path staged --staged "$c" --shape gate_up --m 256 --calls 8 > "$o/ncu_run_$n.txt" 2>&1
  echo "$c rc=$?"
  ncu -i "$o/rep_$n.ncu-rep" --page details > "$o/ncu_gate_up_m256_$n.txt" 2>&1
  ncu -i "$o/rep_$n.ncu-rep" --page source --csv --print-source sass > "$o/sass_$n.csv" 2>&1
  rm -f "$o/rep_$n.ncu-rep"
done
