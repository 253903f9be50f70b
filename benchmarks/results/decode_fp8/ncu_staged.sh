#!/usr/bin/env bash
# ncu of decode_fp8's GEMM (the rule's build; plain launches) at gate_up: the summary (issue
# slots, pipes, stall reasons per issued instruction) and the per-instruction SASS view (warp-state
# samples by instruction). Usage (repository root, on the GPU):
#   benchmarks/results/decode_fp8/ncu_staged.sh OUT_DIR [M ...]   (default 256)
# The runs under staged_h200_79f741a/ncu and ncu_staged_42bec87 profiled the builds of those
# commits' staged kernel (profile_decode.py --path staged --staged BLOCK,STAGES,WM,WN,PER_SM).
set -uo pipefail
o=${1:?output folder}; shift; mkdir -p "$o"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
for m in "${@:-256}"; do
  timeout 150 ncu --clock-control none -k regex:_decode_fp8_kernel --launch-skip 6 --launch-count 1 --set full \
    --import-source no -o "$o/rep_$m" \
    --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,regex:sm__inst_executed_pipe_.*\.sum' \
    python benchmarks/profile_decode.py --path fp8 --shape gate_up --m "$m" --calls 8 > "$o/ncu_run_$m.txt" 2>&1
  echo "M=$m rc=$?"
  ncu -i "$o/rep_$m.ncu-rep" --page details > "$o/ncu_gate_up_m$m.txt" 2>&1
  ncu -i "$o/rep_$m.ncu-rep" --page source --csv --print-source sass > "$o/sass_m$m.csv" 2>&1
  rm -f "$o/rep_$m.ncu-rep"
done
