"""Write .prev/decode_fp8_b16.py: the candidate's decode_fp8.py (candidate.patch applied) with the
pairs stored as two 16-bit stores instead of one 32-bit store (the tile's epilogue only; the same
words in memory), for bench_decode_fp8.py's ``--previous`` arm ``fp8@b16``. Offline the 32-bit
form spills 128 bytes in the 256-token build's epilogue; this one does not (offline.txt).
Usage (repository root): python benchmarks/results/fp8_bf16_pairs/make_b16.py"""
import os

SRC = "escha/kernels/decode_fp8.py"
OLD = '''    v = acc.to(gl.bfloat16).reshape([ROWS, BN // 2, 2])  # a thread's two adjacent tokens (registers only)
    VL: gl.constexpr = v.type.layout
    pair = gl.arange(0, BN // 2, layout=gl.SliceLayout(0, gl.SliceLayout(2, VL)))
    rows = tile * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, gl.SliceLayout(2, VL)))
    half = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, VL)))
    base = ws_ptr + (seg * ((M + 1) // 2) + row0 // 2).to(gl.int64) * (2 * Np)
    offs = (pair[None, :] * Np + rows[:, None]) * 2
    gl.store(base + offs[:, :, None] + half[None, None, :], v, mask=(2 * pair[None, :] < M - row0)[:, :, None])
'''
NEW = '''    tok = gl.arange(0, BN, layout=gl.SliceLayout(0, MMA))
    rows = tile * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, MMA))
    base = ws_ptr + (seg * ((M + 1) // 2) + row0 // 2).to(gl.int64) * (2 * Np)
    offs = (tok[None, :] // 2) * (2 * Np) + rows[:, None] * 2 + tok[None, :] % 2
    gl.store(base + offs, acc.to(gl.bfloat16), mask=tok[None, :] < M - row0)
'''
src = open(SRC).read()
assert src.count(OLD) == 1, "decode_fp8.py is not the candidate's"
src = src.replace(OLD, NEW).replace("from ..", "from escha.").replace("from .", "from escha.kernels.")
os.makedirs(".prev", exist_ok=True)
with open(".prev/decode_fp8_b16.py", "w") as f:
    f.write(src)
