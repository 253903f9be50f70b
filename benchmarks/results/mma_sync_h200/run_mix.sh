#!/usr/bin/env bash
# One H200 call: the halves codec's first state by a shift on half or all of the pairs (pair_mix),
# beside the rule, at 1-8 tokens (bench_decode_wgmma.py --mix-variants), after the GPU tests of the
# variants.
set -u
export PYTHONPATH=$PWD
O=$OUT/mix; mkdir -p $O
timeout 120 python -m pytest -q -x -m gpu tests/test_decode_wgmma.py -k "gemm_variants_within_tolerance" -p no:cacheprovider > $O/gpu_tests.txt 2>&1
tail -3 $O/gpu_tests.txt
timeout 420 python benchmarks/bench_decode_wgmma.py --out $O/bench --ms ${MS:-1,4,8} --shapes ${SHAPES:-gate_up,down,down_8b,qkv_8b} \
    --rounds ${ROUNDS:-5} --mix-variants > $O/bench.txt 2>&1
grep -v "^fragments" $O/bench.txt | tail -40
