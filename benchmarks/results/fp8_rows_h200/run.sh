#!/usr/bin/env bash
# One device call: the fp8 decode GEMM's x' with whole token blocks of rows (the tree's
# decode_fp8._launch, candidate.patch against REV) against REV's kernels and a second form, x'
# rounded up to 16 rows (.prev/decode_fp8_r16.py: the tree's module with that one expression
# changed), one process; then the whole GPU suite on the tree.
# Usage on the device: ESCHA_GIT_SHA=<REV>+rows REV=<REV> bash benchmarks/results/fp8_rows_h200/run.sh
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
O=$OUT/fp8_rows; mkdir -p $O
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader > $O/gpu.txt
timeout 200 python benchmarks/bench_decode_fp8.py --out $O/fp8_k2 --ms 72,96,136,200 --shapes gate_up,down,down_8b \
    --rounds 3 --previous .prev/decode_fp8_$REV.py,.prev/decode_fp8_r16.py > $O/fp8_k2.txt 2>&1
grep -E "^(gate_up|down|GATE)" $O/fp8_k2/decode_fp8.log | cut -c1-300
timeout 360 python -m pytest -q -m gpu -p no:cacheprovider tests > $O/gpu_suite.txt 2>&1
tail -n 3 $O/gpu_suite.txt
cd $OUT && tar czf fp8_rows.tgz fp8_rows
