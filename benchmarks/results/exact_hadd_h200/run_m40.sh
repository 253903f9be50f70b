#!/usr/bin/env bash
# One short H200 call at 29b47cf: gate_up at 40 tokens, the rule (the 64-token block's build for M not
# a multiple of 16, capped at 128 registers) beside its variants at their measured capacity
# (uncapped: 167 registers, 3 an SM; one fragment with a ring of 3; capped at 168).
set -u
export PYTHONPATH=$PWD
O=$OUT/m40; mkdir -p $O
timeout 110 python benchmarks/bench_decode_wgmma.py --out $O/wgmma --ms 40 --shapes gate_up --rounds 2 --variants \
    > $O/wgmma.txt 2>&1
grep -E "^(  |gate_up|GATE)" $O/wgmma/decode_wgmma.log | cut -c1-300
