#!/usr/bin/env bash
# One H200 call: the register-operand decode GEMM with per-warp mma.sync instead of wgmma
# (DecodeWgmmaConfig.mma_sync), gated and timed beside the rule (bench_decode_wgmma.py --sync-variants).
set -u
export PYTHONPATH=$PWD
O=$OUT/mma_sync; mkdir -p $O
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $O/gpu.txt 2>&1
timeout 150 python -m pytest -q -x -m gpu tests/test_decode_wgmma.py -k "gemm_variants_within_tolerance" -p no:cacheprovider > $O/gpu_tests.txt 2>&1
tail -3 $O/gpu_tests.txt
timeout 400 python benchmarks/bench_decode_wgmma.py --out $O/bench --ms ${MS:-1,8,16,32,64} --shapes ${SHAPES:-gate_up,down} \
    --rounds ${ROUNDS:-3} --sync-variants > $O/bench.txt 2>&1
grep -v "^fragments" $O/bench.txt | tail -40
