#!/usr/bin/env bash
# One H200 call: the exact codec's sum by add.f16 and one fragment a program from 16 tokens (the
# rule of this tree) against 11b05e7 (.prev/, ../shift_state_h200/make_prev.sh 11b05e7, carried):
# GPU tests of both decode GEMMs against the reference codec and fp64; bench_decode_wgmma at K=2
# (1-64 tokens, four shapes) and K=3 (8-64, two shapes) with the kernel before as arm
# wgmma@11b05e7; bench_decode_fp8 (its codec now the f16x2 form it had) at 96 and 256 tokens;
# memcheck and racecheck of the register-operand path at 16 and 33 tokens (the rule's new builds).
set -u
export PYTHONPATH=$PWD
O=$OUT/rule; mkdir -p $O
timeout 100 python -m pytest -q -m gpu tests/test_decode_wgmma.py tests/test_decode_fp8.py -p no:cacheprovider \
    -k "bit_exact or (within_tolerance and not variants)" > $O/gpu_tests.txt 2>&1
tail -2 $O/gpu_tests.txt
timeout 190 python benchmarks/bench_decode_wgmma.py --out $O/wgmma_k2 --ms 1,8,16,32,64 --shapes gate_up,down,down_8b,qkv_8b \
    --rounds 3 --previous .prev/decode_wgmma_11b05e7.py > $O/wgmma_k2.txt 2>&1
grep -E "^(gate_up|down|qkv|GATE)" $O/wgmma_k2/decode_wgmma.log | cut -c1-200
timeout 90 python benchmarks/bench_decode_wgmma.py --out $O/wgmma_k3 --bits 3 --ms 8,16,32,64 --shapes gate_up,down \
    --rounds 3 --previous .prev/decode_wgmma_11b05e7.py > $O/wgmma_k3.txt 2>&1
grep -E "^(gate_up|down|GATE)" $O/wgmma_k3/decode_wgmma.log | cut -c1-200
timeout 60 python benchmarks/bench_decode_fp8.py --out $O/fp8 --ms 96,256 --shapes gate_up,down \
    --rounds 3 --previous .prev/decode_fp8_11b05e7.py > $O/fp8.txt 2>&1
grep -E "^(gate_up|down|GATE)" $O/fp8/decode_fp8.log | cut -c1-220
ESCHA_SANITIZER_PATHS=decode-wgmma ESCHA_SANITIZER_MS=16,33 ESCHA_SANITIZER_GRID=small timeout 100 \
    benchmarks/run_sanitizer.sh $O/sanitizer.txt > /dev/null 2>&1
grep -E "ERROR SUMMARY|RACECHECK SUMMARY|cases|FAIL" $O/sanitizer.txt | tail -6
