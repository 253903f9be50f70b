#!/usr/bin/env bash
# One device call: the fp8 decode GEMM's 256-token build with two k-blocks a step (candidate.patch,
# README.md) against the build before it (the unpatched tree, snapshot as the arm fp8@REV), in one
# process, K=2 on seven shapes whose inputs run from 20 to 112 k-blocks, K=3 on the seed's two; then
# the sanitizer. Its first form ran on an H100 at eb5ce3e (h100_eb5ce3e/, with the 128-token variant).
# Usage on the device: ESCHA_GIT_SHA=<REV>+kb2 REV=<REV> bash benchmarks/results/fp8_kb2/run.sh
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
O=$OUT/fp8_kb2; mkdir -p $O
finish() { cd $OUT && tar czf fp8_kb2.tgz fp8_kb2; exit "$1"; }
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader > $O/gpu.txt
bash benchmarks/snapshot_kernels.sh "$REV" || finish 1  # .prev/*_$REV.py from the unpatched tree
git apply benchmarks/results/fp8_kb2/candidate.patch 2>/dev/null || patch -p1 < benchmarks/results/fp8_kb2/candidate.patch \
    || { echo "patch does not apply"; finish 1; }
# Gates first: the e4m3 tiles bit for bit, the partials against the exact e4m3 product (a tile's odd
# last k-block at K = 300 among them, and weights of one k-block), two k-blocks a step bit-identical
# to one on grids that cut the tiles alike, whole calls within the fp8 table, and the GPU fuzz (which
# found the one-k-block NaN of the patch's first form). No timing if any fails.
timeout 240 python -m pytest -q -m gpu tests/test_decode_fp8.py tests/test_fuzz.py -p no:cacheprovider > $O/gpu_tests.txt 2>&1
tail -n 2 $O/gpu_tests.txt
tail -n 1 $O/gpu_tests.txt | grep -q " passed" && ! tail -n 1 $O/gpu_tests.txt | grep -qE "failed|error" \
    || { echo "gates failed: not timed"; finish 1; }
timeout 200 python benchmarks/bench_decode_fp8.py --out $O/fp8_k2 --ms 136,256 \
    --shapes gate_up,down,down_8b,o_tp2,qkv_8b,down_tp2,down_8b_tp2 \
    --rounds 3 --previous .prev/decode_fp8_$REV.py > $O/fp8_k2.txt 2>&1
grep -E "^(gate_up|down|o_|qkv|GATE)" $O/fp8_k2/decode_fp8.log | cut -c1-300
timeout 90 python benchmarks/bench_decode_fp8.py --out $O/fp8_k3 --bits 3 --ms 136,256 --shapes gate_up,down,down_tp2 \
    --rounds 3 --previous .prev/decode_fp8_$REV.py > $O/fp8_k3.txt 2>&1
grep -E "^(gate_up|down|GATE)" $O/fp8_k3/decode_fp8.log | cut -c1-300
ESCHA_SANITIZER_PATHS=decode-fp8 ESCHA_SANITIZER_MS=130,200,256 ESCHA_SANITIZER_SHAPES=257x300,130x1000 timeout 110 \
    benchmarks/run_sanitizer.sh $O/sanitizer.txt > /dev/null 2>&1
grep -E "ERROR SUMMARY|RACECHECK SUMMARY|exit code" $O/sanitizer.txt | tail -n 6
finish 0
