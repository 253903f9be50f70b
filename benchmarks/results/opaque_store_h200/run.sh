#!/usr/bin/env bash
# One H200 call: the register-operand GEMM's partials stored with M and Np through an opaque move
# (the store's offsets and mask computed at the store, not hoisted out of the loop into registers),
# so that every block's build fits its programs an SM without a register cap (K=2 and 3 at 16
# tokens: 96 registers, 5 an SM; 64 tokens: 125-128, 4, for every M), and the fp8 decode GEMM with
# the exact codec's add.f16 sum (its 64-token build capped at 128). Against fe633fc (.prev/, made by
# ../shift_state_h200/make_prev.sh fe633fc, carried): GPU tests of both GEMMs, bench_decode_wgmma
# K=2 at 1-64 tokens on four shapes with the wave one program an SM short (w4 at 16 tokens: the
# occupancy before), K=3 on the seed shapes, bench_decode_fp8 at 96-256, and memcheck / racecheck
# of both paths at 16, 40 and 100 tokens.
set -u
export PYTHONPATH=$PWD
O=$OUT/ab; mkdir -p $O
timeout 100 python -m pytest -q -m gpu tests/test_decode_wgmma.py tests/test_decode_fp8.py -p no:cacheprovider \
    -k "bit_exact or (within_tolerance and not variants)" > $O/gpu_tests.txt 2>&1
tail -n 2 $O/gpu_tests.txt
timeout 230 python benchmarks/bench_decode_wgmma.py --out $O/wgmma_k2 --ms 1,8,16,24,40,64 \
    --shapes gate_up,down,down_8b,qkv_8b --rounds 3 --wave-variants --previous .prev/decode_wgmma_fe633fc.py \
    > $O/wgmma_k2.txt 2>&1
grep -E "^(gate_up|down|qkv|GATE)" $O/wgmma_k2/decode_wgmma.log | cut -c1-260
timeout 70 python benchmarks/bench_decode_wgmma.py --out $O/wgmma_k3 --bits 3 --ms 16,40,64 --shapes gate_up,down \
    --rounds 3 --previous .prev/decode_wgmma_fe633fc.py > $O/wgmma_k3.txt 2>&1
grep -E "^(gate_up|down|GATE)" $O/wgmma_k3/decode_wgmma.log | cut -c1-200
timeout 70 python benchmarks/bench_decode_fp8.py --out $O/fp8 --ms 96,128,256 --shapes gate_up,down \
    --rounds 3 --previous .prev/decode_fp8_fe633fc.py > $O/fp8.txt 2>&1
grep -E "^(gate_up|down|GATE)" $O/fp8/decode_fp8.log | cut -c1-220
ESCHA_SANITIZER_PATHS=decode-wgmma,decode-fp8 ESCHA_SANITIZER_MS=16,40,100 ESCHA_SANITIZER_GRID=small timeout 90 \
    benchmarks/run_sanitizer.sh $O/sanitizer.txt > /dev/null 2>&1
grep -E "ERROR SUMMARY|RACECHECK SUMMARY|cases|FAIL" $O/sanitizer.txt | tail -n 6
cd $OUT && tar czf ab.tgz ab
