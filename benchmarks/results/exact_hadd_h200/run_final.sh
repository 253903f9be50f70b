#!/usr/bin/env bash
# One H200 call at the final rule (K=2's 16-token build capped at 128 registers again): bench_decode_wgmma
# at 1-64 tokens on four shapes against 11b05e7 (.prev/, carried), then the Qwen3-14B-shaped model's
# decode tokens/s at batch 1 and 8 (bench_e2e.py: bf16 and escha, CUDA graphs).
set -u
export PYTHONPATH=$PWD
O=$OUT/final; mkdir -p $O
timeout 200 python benchmarks/bench_decode_wgmma.py --out $O/wgmma_k2 --ms 1,8,16,32,64 --shapes gate_up,down,down_8b,qkv_8b \
    --rounds 3 --previous .prev/decode_wgmma_11b05e7.py > $O/wgmma_k2.txt 2>&1
grep -E "^(gate_up|down|qkv|GATE)" $O/wgmma_k2/decode_wgmma.log | cut -c1-200
timeout 250 python benchmarks/bench_e2e.py --device cuda --arms bf16,escha --repeats 2 --no-profile \
    --out $O/e2e_h200.json > $O/e2e.txt 2>&1
tail -8 $O/e2e.txt
cd $OUT && tar czf final.tgz final && rm -rf final
