#!/usr/bin/env bash
# One H200 call: the register-operand GEMM's M rounded up to 16 from blocks of 16 tokens
# (decode_wgmma.partial_rows: the partials hold that many rows, the output transform reads the
# first M), against fe633fc (.prev/, made by ../shift_state_h200/make_prev.sh fe633fc, carried):
# bench_decode_wgmma at 24, 40, 48 and 56 tokens on the seed shapes and 8B down (the call, and its
# three kernels each alone), then the whole gpu-marked suite (run_h200.sh gpu-suite's test step).
set -u
export PYTHONPATH=$PWD
O=$OUT/partial_rows; mkdir -p $O
timeout 110 python benchmarks/bench_decode_wgmma.py --out $O/wgmma --ms 24,40,48,56 --shapes gate_up,down,down_8b \
    --rounds 3 --breakdown --previous .prev/decode_wgmma_fe633fc.py > $O/wgmma.txt 2>&1
grep -E "^(gate_up|down|GATE)" $O/wgmma/decode_wgmma.log | cut -c1-330
timeout 440 python -m pytest -q -m gpu -p no:cacheprovider tests > $O/gpu_suite.txt 2>&1
echo "gpu_suite rc=$?"; tail -n 3 $O/gpu_suite.txt
cd $OUT && tar czf partial_rows.tgz partial_rows
