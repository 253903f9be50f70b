#!/usr/bin/env bash
# One H200 call: the pair codec's first state by a shift (this tree) against mul.hi (52b2e88, made by
# make_prev.sh into .prev/, carried): the GPU tests of both decode GEMMs that compare them with the
# reference codec and fp64, then bench_decode_wgmma (1-64 tokens) and bench_decode_fp8 (96-256) with
# the previous kernels as arms wgmma@52b2e88 / fp8@52b2e88, in one process each.
set -u
export PYTHONPATH=$PWD
O=$OUT/shift; mkdir -p $O
timeout 170 python -m pytest -q -m gpu tests/test_decode_wgmma.py tests/test_decode_fp8.py -p no:cacheprovider \
    -k "bit_exact or within_tolerance or partials_are or outlier" > $O/gpu_tests.txt 2>&1
tail -2 $O/gpu_tests.txt
timeout 230 python benchmarks/bench_decode_wgmma.py --out $O/wgmma --ms 1,8,16,32,64 --shapes gate_up,down,down_8b,qkv_8b \
    --rounds 3 --previous .prev/decode_wgmma_52b2e88.py > $O/wgmma.txt 2>&1
grep -E "^(gate_up|down|qkv|GATE)" $O/wgmma/decode_wgmma.log | cut -c1-200
timeout 170 python benchmarks/bench_decode_fp8.py --out $O/fp8 --ms 96,128,192,256 --shapes gate_up,down,down_8b \
    --rounds 3 --previous .prev/decode_fp8_52b2e88.py > $O/fp8.txt 2>&1
grep -E "^(gate_up|down|GATE)" $O/fp8/decode_fp8.log | cut -c1-220
