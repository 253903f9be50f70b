#!/usr/bin/env bash
# The candidate's other form as arms of the same benchmark (run from the repository root, after
# candidate.patch is applied): state s + 8 taken out by mul.hi.u32 by 2**16 (IMAD.HI, FMA-heavy)
# instead of shr.u32 16, in copies of the patched modules under .prev/ (decode_wgmma_mulhi.py,
# and decode_fp8_mulhi.py importing it), for bench_decode_wgmma.py / bench_decode_fp8.py --previous.
set -eu
SED='s/shr\.u32 sb, \$3, 16;/mul.hi.u32 sb, $3, 65536;/; s/shr\.u32 sb, \$5, 16;/mul.hi.u32 sb, $5, 65536;/' \
    bash benchmarks/snapshot_kernels.sh mulhi
[ "$(grep -c 'mul.hi.u32 sb' .prev/decode_wgmma_mulhi.py)" = 2 ] || { echo "mul.hi form not made"; exit 1; }
