#!/usr/bin/env bash
# The loop's counters on main: ncu of the loop at gate_up M=8 and 64 with the stall reasons per
# issued instruction, the decode GEMM against bf16 cuBLAS at K=2 and K=3 (M 1..256, seed shapes),
# then the split-K grid sweep of the register-operand kernel (fit_splitk.py --kernel decode-wgmma).
set -uo pipefail
o=$OUT/b; mkdir -p $o
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
step() { local name=$1 limit=$2; shift 2; local t0=$SECONDS
  timeout $limit "$@" > $o/$name.txt 2>&1
  echo "$name rc=$? s=$((SECONDS-t0))" >> $o/steps.log; }
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv;
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)";
  echo "git ${ESCHA_GIT_SHA:-unknown} date $(date -u +%FT%TZ)"; } > $o/env.txt 2>&1
for m in 8 64; do
  step "ncu_gemm_gate_up_m$m" 110 ncu --clock-control none -k regex:_decode_wgmma_kernel --launch-skip 6 \
    --launch-count 1 --set full --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio' \
    python benchmarks/profile_decode.py --shape gate_up --m "$m" --calls 8
done
step decode_k2 90 python benchmarks/bench_decode_wgmma.py --out $o/decode_k2 --rounds 3
step decode_k3 90 python benchmarks/bench_decode_wgmma.py --out $o/decode_k3 --rounds 3 --bits 3
step splitk_wgmma 170 python benchmarks/fit_splitk.py --kernel decode-wgmma --out $o/splitk
