#!/usr/bin/env bash
# Ran in the same H200 call as ../../bench_h200_decode_fe633fc/ (after run_h200.sh system, fe633fc):
# the register-operand call and its three kernels each alone at 40, 48 and 64 tokens.
set -u
export PYTHONPATH=$PWD
timeout 90 python benchmarks/bench_decode_wgmma.py --out $OUT/m40 --ms 40,48,64 --shapes gate_up,down --rounds 3 \
    --breakdown > $OUT/m40.txt 2>&1
