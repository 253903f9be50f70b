"""The fp8 decode GEMM (Hopper): its column order and the activations stored in it (CPU, the
Triton interpreter), its compiled form (PTX for sm_90a), and on the GPU its e4m3 fragments bit
for bit, its partials against the exact product of its e4m3 operands, and whole products within
the fp8 paths' tolerance."""
import dataclasses
import importlib
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from escha.format import dequantize, random_qweight
from escha.format import input_transform
from escha.kernels.compile_check import cuobjdump, programs_per_sm, res_usage
from escha.kernels.decode_wgmma import MEASURED_TRITON, summed_partials
from escha.kernels.transforms import prepare_input

df = importlib.import_module("escha.kernels.decode_fp8")

# Tolerances. The whole product: the fp8 paths' table (docs/KERNELS.md, Prefill, "Accuracy": e4m3
# operands, per-term rms sqrt(2) * 2**-4 / sqrt(3), times 1.5). The partials against the fp64
# product of the same e4m3 operands: only the tensor core's accumulation differs, which keeps
# about 13-14 bits each time it adds a k32 step's products into the fp32 accumulator (DeepSeek-V3
# technical report, section 3.3.2, "Increasing Accumulation Precision", measured on Hopper). On
# the H200 the normwise error grows as the square root of the k32 steps one accumulator takes:
# 1.15e-3 at 108, 2.25e-3 at 432 (8B down at 256 and 1024 tokens,
# benchmarks/results/decode_fp8/h200_ad4f7ce), about 2**-13 sqrt(n). A program's part of a tile
# is at most K/32 = 448 steps (K = 14336): 2.3e-3. The partials are then stored as bf16: a
# relative rounding of at most 2**-9 an element, rms 2**-9 / sqrt(3) = 1.1e-3, independent of the
# accumulation's, so in quadrature 2.6e-3 (bf16 partials measured 1.82-2.06e-3 on the H200 at
# 6ace8cd, benchmarks/results/decode_fp8/partials_bf16_h200_6ace8cd); the bound is 2**-8.
FP8_TOL = 0.077
PARTIALS_TOL = 2.0**-8


def test_column_order_keeps_a_threads_tiles():
    """The fp8 MMA column order is a permutation in which lane t's columns (4 t + e' and 16 + 4 t
    + e' of every k32 step) are exactly tiles 2t and 2t + 1, and a register's four bytes are
    columns c, c + 8 of both tiles."""
    order = df.fp8_mma_column_order()
    assert sorted(order.tolist()) == list(range(128))
    kk = torch.arange(128)
    t = (kk // 4) % 4
    assert torch.equal(order // 32, t)  # tiles 2t, 2t + 1 = T columns 32 t .. 32 t + 31
    reg = order.reshape(32, 4)  # the four bytes of each register
    assert torch.equal(reg[:, 1] - reg[:, 0], torch.full((32,), 8))
    assert torch.equal(reg[:, 2] - reg[:, 0], torch.full((32,), 16))
    assert torch.equal(reg[:, 3] - reg[:, 0], torch.full((32,), 24))


def test_x16_codec_is_16_times_the_codec_exactly():
    """The fp8 GEMM's codec (``decode_wgmma._pair_values_x16``): xor constant 0x4B60 in place of
    3INST's 0x3B60 makes each half 16 times its value, and the halves' fp16 sum 16 times 3INST's
    value, bit for bit, for all 65536 states; 16 T stays below e4m3's 448."""
    from escha.format import codebooks
    s = torch.arange(1 << 16, dtype=torch.int64)
    x = (s * 89226354 + 64248484) % 2**32

    def halves_sum(const: int) -> torch.Tensor:
        w = (x & 0x8FFF8FFF) ^ const
        lo = (w & 0xFFFF).to(torch.int16).view(torch.float16)
        hi = ((w >> 16) & 0xFFFF).to(torch.int16).view(torch.float16)
        return lo + hi  # one fp16 addition, rounded to nearest even

    t = halves_sum(0x3B603B60)
    assert torch.equal(t.view(torch.int16), codebooks.get("3inst").values(s.to(torch.int32)).view(torch.int16))
    t16 = halves_sum(0x4B604B60)
    assert torch.equal(t16.float(), t.float() * 2**df.DECODE_FP8_SCALE_LOG2.value)
    assert float(t16.float().abs().max()) < 64


@pytest.mark.parametrize("m,k", [(1, 128), (5, 300), (70, 520)])
@pytest.mark.parametrize("outlier", [False, True])
@pytest.mark.parametrize("mma_order", [True, False])
def test_input_transform_fp8(m, k, outlier, mma_order):
    """The input transform's fp8 form (Triton interpreter on the CPU): x' * 2**e rounded to e4m3
    (|x' 2**e| <= 2**8, so no saturation), in the fp8 MMA column order with 2**-e / 16 (decode_fp8's weights are 16 T) or in x's
    own order with 2**-e: back in T's order and scaled, each value is x' within e4m3's rounding
    (half an ulp: 2**-4 relative, or 2**-10 2**-e below the normal range), also for a row with a
    1000x outlier."""
    qw = random_qweight(64, k, bits=2, seed=k)
    x = torch.randn(m, k, dtype=torch.bfloat16)
    if outlier:
        x[0, k // 3] = 1000.0
    xq, inv, _ = prepare_input(x, qw, keep=False, fp8=True, mma_order=mma_order)
    assert xq.dtype == torch.float8_e4m3fn and xq.shape == (m, qw.padded_shape[1])
    assert torch.equal(torch.frexp(inv).mantissa, torch.full_like(inv, 0.5))  # powers of two
    assert float(xq.float().abs().max()) <= 256
    order = df.fp8_mma_column_order() if mma_order else torch.arange(128)
    back = torch.empty_like(xq.float())
    for b in range(xq.shape[1] // 128):
        back[:, 128 * b + order] = xq.float()[:, 128 * b:128 * b + 128]
    step = (inv * (2**df.DECODE_FP8_SCALE_LOG2.value if mma_order else 1)).double()[:, None]  # 2**-e
    got = back.double() * step
    want = input_transform(x.double(), qw).double()
    assert bool(((got - want).abs() <= 2.0**-4 * want.abs() + 2.0**-10 * step).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_input_transform_fp8_applies_the_norm(dtype):
    """The fp8 form with the RMSNorm in the input transform (what ``decode_fp8(..., norm=)``
    launches; Triton interpreter on the CPU): the normalised rows' x' within e4m3's rounding, and
    the plain rows' x' far from it (the norm's weight scales the columns unevenly)."""
    from escha.norm import RowNorm
    qw = random_qweight(64, 300, bits=2, seed=3)
    g = torch.Generator().manual_seed(4)
    norm = RowNorm((torch.rand(300, generator=g) + 0.5).to(dtype), 1e-6)
    x = (torch.randn(6, 300, generator=g) * 3).to(dtype)
    xq, inv, _ = prepare_input(x, qw, norm=norm, keep=False, fp8=True, mma_order=True)
    order = df.fp8_mma_column_order()
    back = torch.empty_like(xq.float())
    for b in range(xq.shape[1] // 128):
        back[:, 128 * b + order] = xq.float()[:, 128 * b:128 * b + 128]
    step = (inv * 2**df.DECODE_FP8_SCALE_LOG2.value).double()[:, None]
    got = back.double() * step
    want = input_transform(norm.apply(x).double(), qw).double()
    assert bool(((got - want).abs() <= 2.0**-4 * want.abs() + 2.0**-10 * step).all())
    plain = input_transform(x.double(), qw).double()
    assert float((got - plain).norm() / plain.norm()) > 0.1


def test_input_transform_rejects_orders_that_do_not_apply():
    qw = random_qweight(64, 128, bits=2, seed=0)
    x = torch.randn(2, 128)
    for kwargs, match in (({"fp8": True, "halves": True}, "halves"), ({"bf16": True, "halves": True}, "halves"),
                          ({"bf16": True, "mma_order": True}, "mma_order"), ({"fp8": True, "bf16": True}, "one")):
        with pytest.raises(ValueError, match=match):
            prepare_input(x, qw, keep=False, **kwargs)


@pytest.mark.parametrize("m,block", [(1, 64), (64, 64), (65, 128), (128, 128), (129, 256), (256, 256), (300, 256),
                                     (5000, 256)])
def test_rule_blocks_and_one_wave(m, block):
    cfg = df._config(17408, 5120, m, None, None)
    assert cfg.block_tokens == block
    assert (cfg.stages, cfg.warps_m, cfg.warps_n, cfg.max_registers) == df.BUILDS[block]
    assert cfg.bf16_pairs == (block in (64, 128))
    blocks = -(-m // block)
    assert cfg.programs == min(17408 // (16 * cfg.warps_m) * 40 // df.MIN_STEPS,
                               -(-df.PROGRAMS_PER_SM[block] * df.HOPPER_SMS // blocks))


def test_config_with_another_block():
    """config_with_block: that block's ring and wave, over the token blocks it makes; an unbuilt
    block is refused."""
    qw = random_qweight(512, 1024, bits=2, seed=0)
    cfg = df.config_with_block(qw, 300, 128)
    assert (cfg.block_tokens, cfg.stages, cfg.warps_m, cfg.warps_n, cfg.max_registers) == (128, *df.BUILDS[128])
    assert cfg.programs == min(8 * 8 // df.MIN_STEPS, -(-df.PROGRAMS_PER_SM[128] * df.HOPPER_SMS // 3))
    assert df.config_with_block(qw, 300, None) == df.decode_fp8_config(qw, 300)
    with pytest.raises(ValueError, match="block_tokens must be one of"):
        df.config_with_block(qw, 300, 32)


def test_rule_refuses_no_tokens():
    qw = random_qweight(64, 128, bits=2, seed=0)
    with pytest.raises(ValueError, match="at least one token"):
        df.decode_fp8_config(qw, 0)


def test_partials_refuse_more_tokens_than_rows():
    qw = random_qweight(64, 128, bits=2, seed=0)
    xq = torch.zeros(4, 128, dtype=df.FP8_DTYPE)
    with pytest.raises(ValueError, match="tokens must be 1..4"):
        df.gemm_partials(xq, qw, df.decode_fp8_config(qw, 4), tokens=5)


def test_refuses_the_cpu():
    qw = random_qweight(64, 128, bits=2, seed=0)
    with pytest.raises(ValueError, match="Hopper"):
        df.decode_fp8(torch.randn(2, 128), qw)


_COMPILE = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from escha.kernels.decode_fp8 import BUILDS, compile_options, gemm_source
out = {}
for bn in sorted(BUILDS):
    for bits in (2, 3):
        k = triton.compile(gemm_source(bits, bn), target=GPUTarget("cuda", 90, 32), options=compile_options(bn))
        out[f"{bits},{bn}"] = [k.metadata.shared, k.asm["cubin"].hex(), k.asm["ptx"]]
json.dump(out, sys.stdout)
"""


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """(shared bytes, cubin, PTX) of the rule's GEMM builds at K = 2 and 3, compiled for sm_90a
    in a child process (compiling Gluon and the CPU interpreter do not mix in one process)."""
    script = tmp_path_factory.mktemp("sm90") / "compile_decode_fp8.py"
    script.write_text(_COMPILE)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    return {tuple(int(v) for v in k.split(",")): p for k, p in json.loads(run.stdout).items()}


def _step(ptx: str) -> str:
    """The PTX of a step: from its fetch of the words two steps ahead (the loads after the
    prologue's two steps) to its wait for MMAs."""
    loads = [mo.start() for mo in re.finditer(r"ld\.global\.v4\.b32", ptx)]
    start = loads[2 * len(loads) // 3]
    return ptx[start:ptx.index("wgmma.wait_group.sync.aligned", start)]




@pytest.mark.parametrize("bits", [2, 3])
@pytest.mark.parametrize("bn", sorted(df.BUILDS))
def test_ptx_fp8_mma_from_shared_memory_in_flight(builds, bits, bn):
    """Each step: a thread's 64 / warps_n weights of the tile (16 T straight from the codec, no
    multiply, and one cvt to e4m3x2 a pair) stored with one stmatrix x4 each 16, a proxy fence, then four wgmma m64n(BN / warps_n)k32 e4m3 x e4m3 with both
    operands from shared memory (descriptors, no A registers) and a wait that leaves them in
    flight. In the SASS, one wait for all but the last group (the step's) and one for all (after a
    tile's steps): ptxas added no wait of its own (it did when a tile's store sat in the step loop)."""
    _, _, wn, _ = df.BUILDS[bn]
    _, cubin, ptx = builds[(bits, bn)]
    step = _step(ptx)
    mmas = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k32\.f32\.e4m3\.e4m3\s+\{[^}]*\},\s*%rd\d+,\s*%rd\d+",
                      step)
    assert len(mmas) == 4 and all(n == str(bn // wn) for n in mmas)
    assert len(re.findall(r"wgmma\.mma_async", ptx)) == 4
    assert len(re.findall(r"stmatrix\.sync\.aligned\.m8n8\.x4\.shared\.b16", step)) == 4 // wn
    assert len(re.findall(r"cvt\.rn\.satfinite\.e4m3x2\.f16x2", step)) == 32 // wn
    assert not re.search(r"mul(?:\.rn)?\.f16", step)
    assert len(re.findall(r"0x4B604B60", step)) == 64 // wn  # the codec's lop3 of 16 T, a word each
    assert step.rindex("stmatrix") < step.index("fence.proxy.async") < step.index("wgmma.mma_async")
    assert ptx.count("wgmma.wait_group.sync.aligned 1") == 1 and ptx.count("wgmma.wait_group.sync.aligned 0") == 1
    # The words come straight into registers (one 16-byte load a row group, two steps ahead), not
    # through shared memory; three CTA barriers a step (were five with the words' TMA ring): one
    # before the activations' mbarrier wait (it also orders the decoded tile before the MMAs), one
    # after the MMA wait (the step's buffers free), one between the refill's expect and its copy.
    assert "ld.shared" not in step and len(re.findall(r"cp\.async\.bulk\.tensor", ptx)) == df.BUILDS[bn][0] + 1
    assert len(re.findall(r"ld\.global\.v4\.b32", step)) == 2 // wn
    assert len(re.findall(r"ld\.global\.v4\.b32", ptx)) == 3 * (2 // wn)
    start = ptx.index("stmatrix")
    loop = ptx[start:ptx.index("cp.async.bulk.tensor", start)]
    from escha.kernels.triton_compat import TRITON_RELEASE
    # Exact under the release measured (3.6); 3.9's analysis places its barriers differently (four,
    # still fewer than the word ring's five).
    if TRITON_RELEASE != MEASURED_TRITON:
        assert loop.count("bar.sync") <= 4
    else:
        assert loop.count("bar.sync") == 3
        assert re.search(r"bar\.sync\s+0;(\s+(//.*|\.loc.*|\$L\w+:|mov.*|\{|\}|\.reg.*|waitLoop:))*\s+mbarrier\.try_wait", loop)
    sass = cuobjdump(bytes.fromhex(cubin), "-sass")
    assert len(re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x1", sass)) == 1
    assert len(re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x0", sass)) == 1
    # Dependent launch: the wait for x' once, after the first word loads and before any activation
    # copy; the release once, after the loop.
    assert ptx.count("griddepcontrol.wait") == 1 and ptx.count("griddepcontrol.launch_dependents") == 1
    assert ptx.index("ld.global") < ptx.index("griddepcontrol.wait") < ptx.index("cp.async.bulk.tensor")
    assert ptx.rindex("cp.async.bulk.tensor") < ptx.index("griddepcontrol.launch_dependents")


@pytest.mark.parametrize("bits", [2, 3])
@pytest.mark.parametrize("bn", sorted(df.BUILDS))
def test_ptx_partials_leave_in_their_form(builds, bits, bn):
    """A [16 WM, BN] accumulator over 32 WM WN threads is BN / (2 WN) values a thread. In the
    paired builds they leave as bf16 pairs, a thread's two adjacent tokens in one 32-bit word:
    BN / (4 WN) stores, each after one cvt of a pair to bf16x2, with no shared memory or shuffle
    to pair them. The 256-token build stores them as fp32, one 32-bit store a value, no cvt.
    No store of another width either way."""
    _, wm, wn, _ = df.BUILDS[bn]
    _, _, ptx = builds[(bits, bn)]
    stores = re.findall(r"st\.global[.\w]*", ptx)
    values = 16 * wm * bn // (32 * wm * wn)
    cvts = len(re.findall(r"cvt\.rn\.bf16x2\.f32", ptx))
    if bn in df.PAIRED_BLOCKS:
        assert stores == ["st.global.b32"] * (values // 2) and cvts == values // 2
    else:
        assert stores == ["st.global.b32"] * values and cvts == 0
    epilogue = ptx[ptx.index("wgmma.wait_group.sync.aligned 0"):ptx.rindex("st.global")]
    assert "st.shared" not in epilogue and "shfl" not in epilogue


def test_partial_values_unpack_the_pairs():
    """Word row i holds token 2i's bf16 partial in its low half and 2i + 1's in its high half; fp32
    partials come back as they are."""
    vals = torch.randn(3, 8, 256).to(torch.bfloat16)
    bits = vals.view(torch.int16).to(torch.int32) & 0xFFFF
    words = bits[:, 0::2] | (bits[:, 1::2] << 16)
    for tokens in (7, 8):
        assert torch.equal(df.partial_values(words, tokens).view(torch.int16), vals[:, :tokens].view(torch.int16))
    with pytest.raises(ValueError, match="int32 words"):
        df.partial_values(words, 9)
    fp32 = vals.float()
    assert df.partial_values(fp32, 5).data_ptr() == fp32.data_ptr() and df.partial_values(fp32, 5).shape == (3, 5, 256)
    for bad in (fp32, words.float()):
        with pytest.raises(ValueError, match="fp32 partials"):
            df.partial_values(bad, 9)


@pytest.mark.parametrize("bits", [2, 3])
@pytest.mark.parametrize("bn", sorted(df.BUILDS))
def test_programs_per_sm_is_the_compiled_occupancy(builds, bits, bn):
    """PROGRAMS_PER_SM is what an sm_90 SM holds of the rule's build: 64K registers (8 a thread at a
    time, 32 threads a warp), 228 KB of shared memory (1 KB reserved a program). Exact, and
    without spills, under the release it was measured with (3.6); under another the table may
    hold fewer programs than fit, never more."""
    from escha.kernels.triton_compat import TRITON_RELEASE
    _, wm, wn, _ = df.BUILDS[bn]
    shared, cubin, _ = builds[(bits, bn)]
    usage = res_usage(bytes.fromhex(cubin))
    fits = programs_per_sm(usage["REG"], shared, threads=32 * wm * wn)
    if TRITON_RELEASE == MEASURED_TRITON:  # the release measured: exact, and no spills
        assert usage["STACK"] == 0
        assert df.PROGRAMS_PER_SM[bn] == fits
    else:
        assert df.PROGRAMS_PER_SM[bn] <= fits


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("bits", [2, 3])
@pytest.mark.parametrize("shape", [(128, 128), (300, 520), (17408, 5120)])
def test_fragments_bit_exact(bits, shape):
    """The decoded tile, as 4-warp (16 rows a warp) and 8-warp (8 rows a warp) builds decode it."""
    qw = random_qweight(*shape, bits=bits, seed=sum(shape) + bits, device="cuda")
    want = df.mma_order(df.reference_core(qw))
    for warps_n in (1, 2):
        got = df.decoded_fragments(qw, warps_n)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), warps_n


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("m,k", [(1, 700), (64, 700), (100, 700), (128, 700), (256, 700), (300, 700),
                                 (130, 14336), (1024, 14336)])
@pytest.mark.parametrize("bits", [2, 3])
def test_partials_are_the_e4m3_product(m, k, bits):
    """The GEMM's partials, summed, are x'_q (16 T)^T of its own e4m3 operands within the
    accumulation bound, in every block's build, on its wave and on grids of one step a program
    and one program."""
    qw = random_qweight(300, k, bits=bits, seed=m + bits, device="cuda")
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    xq, _, _ = prepare_input(x, qw, keep=False, fp8=True, mma_order=True)
    ref = xq.double() @ df.mma_order(df.reference_core(qw)).double().T
    for block in df.BUILDS:
        cfg = df.config_with_block(qw, m, block, x.device)
        steps = qw.padded_shape[0] // (16 * cfg.warps_m) * (qw.padded_shape[1] // 128)
        for programs in (cfg.programs, steps, 1):
            ws, counts = df.gemm_partials(xq, qw, dataclasses.replace(cfg, programs=programs))
            got = summed_partials(df.partial_values(ws, m), counts)
            assert float((got - ref).norm() / ref.norm()) <= PARTIALS_TOL, (block, programs)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("m", [1, 72, 100, 200])
def test_partials_ignore_x_rows_past_the_tokens(m):
    """An x' with whole token blocks of rows (as the call allocates it), the rows past the tokens
    NaN: the partials of the tokens are the same bits as those of an x' of exactly their rows."""
    qw = random_qweight(300, 700, bits=2, seed=m, device="cuda")
    x = torch.randn(m, 700, device="cuda", dtype=torch.bfloat16)
    xq, _, _ = prepare_input(x, qw, keep=False, fp8=True, mma_order=True)
    cfg = df.decode_fp8_config(qw, m, x.device)
    rows = -(-m // cfg.block_tokens) * cfg.block_tokens
    padded = torch.full((rows, xq.shape[1]), 0x7F, dtype=torch.uint8, device="cuda").view(xq.dtype)
    padded[:m] = xq
    ws, counts = df.gemm_partials(xq, qw, cfg)
    want = summed_partials(df.partial_values(ws, m), counts)
    ws, counts = df.gemm_partials(padded, qw, cfg, tokens=m)
    got = summed_partials(df.partial_values(ws, m), counts)
    assert got.shape == want.shape == (m, qw.padded_shape[0]) and torch.isfinite(got).all()
    assert torch.equal(got, want)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("m", [1, 7, 64, 65, 128, 200, 256, 300, 600])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gemm_within_tolerance(m, dtype):
    qw = random_qweight(300, 700, bits=2 + m % 2, seed=m, device="cuda")
    x = torch.randn(m, 700, device="cuda", dtype=dtype)
    out = torch.full((m, 300), float("nan"), device="cuda", dtype=dtype)
    y = df.decode_fp8(x, qw, out=out)
    ref = x.double() @ dequantize(qw).double().T
    assert y.dtype == dtype and y.shape == (m, 300) and torch.isfinite(y).all()
    assert float((y.double() - ref).norm() / ref.norm()) <= FP8_TOL


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("m", [1, 130])
def test_gemm_with_an_outlier_row(m):
    """A token with one input 1000x the others (massive activations): its scale is a power of
    two from its max |x|, and the product stays within the fp8 table."""
    qw = random_qweight(300, 700, bits=2, seed=m, device="cuda")
    x = torch.randn(m, 700, device="cuda", dtype=torch.bfloat16)
    x[0, 123] = 1000.0
    y = df.decode_fp8(x, qw)
    ref = x.double() @ dequantize(qw).double().T
    for rows in (slice(0, 1), slice(0, m)):
        assert float((y[rows].double() - ref[rows]).norm() / ref[rows].norm()) <= FP8_TOL


@pytest.mark.gpu
@gpu
def test_a_nan_or_inf_row_stays_in_its_row():
    qw = random_qweight(256, 512, bits=2, seed=3, device="cuda")
    x = torch.randn(130, 512, device="cuda", dtype=torch.bfloat16)
    x[17, 5] = float("nan")
    x[40, 9] = float("inf")
    y = df.decode_fp8(x, qw)
    assert torch.isnan(y[17]).all() and torch.isnan(y[40]).all()
    assert torch.isfinite(torch.cat([y[:17], y[18:40], y[41:]])).all()
