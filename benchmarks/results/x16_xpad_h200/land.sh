#!/usr/bin/env bash
# One H200 call on the landed tree (0340a46 and on): every gpu-marked test, then ncu of the
# register-operand loop at gate_up M = 8, 40, 48, 64 (issue #12's ncu summary; 40 beside 48 since
# x' takes the rounded rows) and its one-table summary.
# Usage on the device: ESCHA_GIT_SHA=<sha> bash benchmarks/results/x16_xpad_h200/land.sh
set -u
export PYTHONPATH=$PWD
O=$OUT/land; mkdir -p $O
{ nvidia-smi --query-gpu=name,driver_version --format=csv
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  echo "git ${ESCHA_GIT_SHA:-unknown} date $(date -u +%FT%TZ)"; } > $O/env.txt 2>&1
timeout 330 python -m pytest -q -m gpu -p no:cacheprovider tests > $O/gpu_suite.txt 2>&1
echo "suite rc=$?"; tail -n 2 $O/gpu_suite.txt
for m in 8 40 48 64; do
  timeout 40 ncu --clock-control none -k regex:_decode_wgmma_kernel --launch-skip 6 --launch-count 1 --set full \
    --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio' \
    python benchmarks/profile_decode.py --shape gate_up --m $m --calls 8 > $O/ncu_gemm_gate_up_m$m.txt 2>&1
  echo "ncu $m rc=$?"
done
python benchmarks/ncu_summary.py $O/ncu_gemm_gate_up_m{8,40,48,64}.txt --md $O/ncu_summary.md && cat $O/ncu_summary.md
