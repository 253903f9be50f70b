"""The register-operand decode GEMM (Hopper): its in-memory layout, checked on the CPU by
emulating each thread's fragment, its compiled form (PTX for sm_90a), and on the GPU its
fragments bit for bit and its products within the decode tolerance table."""
import dataclasses
import importlib
import re

import pytest
import torch

from escha.format import decode_trellis, dequantize, random_qweight
from escha.norm import HeadNorm
from escha.kernels.compile_check import programs_per_sm, res_usage
from escha.format.bitstream import states_from_words
from escha.format.codebooks import get as codebook

# The module (escha.kernels exports the op function under the same name).
dw = importlib.import_module("escha.kernels.decode_wgmma")

# The wgmma A-operand layout (fp16, k_width 2) of a [64, 128] block as Triton 3.6 defines it,
# restated from the PTX ISA's m64nNk16 fragment: register bits -> (row, col), lanes, warps.
A_REG_BASES = [[0, 1], [8, 0], [0, 8], [0, 16], [0, 32], [0, 64]]
A_LANE_BASES = [[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]]
A_WARP_BASES = [[16, 0], [32, 0]]


def _coord(reg: int, lane: int, warp: int) -> tuple[int, int]:
    r = c = 0
    for bases, v in ((A_REG_BASES, reg), (A_LANE_BASES, lane), (A_WARP_BASES, warp)):
        for i, (dr, dc) in enumerate(bases):
            if v >> i & 1:
                r ^= dr
                c ^= dc
    return r, c


@pytest.mark.parametrize("bits", [1, 2, 3])
def test_row_windows_hold_every_state(bits):
    qw = random_qweight(37, 200, bits=bits, seed=bits)
    v = dw.row_windows(qw.trellis, bits).to(torch.int64) & 0xFFFFFFFF  # [TN, TK, 16, 2]
    full = (v[..., 0] << 32) | v[..., 1]
    c = torch.arange(16)
    got = (full[..., None] >> (48 - bits * c)) & 0xFFFF  # [TN, TK, 16 rows, 16 cols]
    want = states_from_words(qw.trellis, bits).reshape(*qw.trellis.shape[:2], 16, 16)
    assert torch.equal(got, want.to(torch.int64))


def _emulate_fragments(qw) -> torch.Tensor:
    """T in MMA column order as the kernel's threads build it from pack_words: each thread
    (warp w, lane 4g + t) reads its 8 words at the kernel's offsets and decodes its registers."""
    words = dw.pack_words(qw).to(torch.int64) & 0xFFFFFFFF  # [Np/128, Kp/128, 2, 1024]
    words = words.permute(0, 2, 1, 3).reshape(-1, words.shape[1], dw.FRAGMENT_WORDS)  # [Np/64, Kp/128, 1024]
    np_, kp = qw.padded_shape
    out = torch.empty(np_, kp, dtype=torch.float16)
    cb = codebook(0)
    nb_, kb_ = np_ // 64, kp // 128
    for w in range(4):
        for lane in range(32):
            g, t = lane // 4, lane % 4
            for reg in range(64):
                e, mh, h, s = reg & 1, reg >> 1 & 1, reg >> 2 & 1, reg >> 3
                row, col = _coord(reg, lane, w)
                assert (row, col) == (16 * w + 8 * mh + g, 16 * s + 8 * h + 2 * t + e)
                off = ((w * 2 + mh) * 32 + 4 * g + t) * 4 + 2 * h
                v = (words[:, :, off] << 32) | words[:, :, off + 1]  # [nb, kb]
                state = (v >> (48 - qw.bits * (s + 8 * e))) & 0xFFFF
                vals = cb.values(state.to(torch.int32))
                out.view(nb_, 64, kb_, 128)[:, row, :, col] = vals
    return out


@pytest.mark.parametrize("bits", [2, 3])
def test_emulated_fragments_are_the_core_in_mma_order(bits):
    qw = random_qweight(130, 260, bits=bits, seed=7 + bits)
    want = dw.mma_order_core(decode_trellis(qw).to(torch.float16))
    assert torch.equal(_emulate_fragments(qw).view(torch.int16), want.view(torch.int16))


def test_mma_column_order_is_a_permutation_of_whole_tiles_per_thread():
    order = dw.mma_column_order()
    assert sorted(order.tolist()) == list(range(128))
    kk = torch.arange(128)
    t = (kk // 2) % 4
    assert torch.equal(order // 32, t)  # lane t's columns are tiles 2t and 2t + 1


@pytest.mark.parametrize("shape,m,programs", [((17408, 5120), 1, 660), ((17408, 5120), 64, 528),
                                              ((17408, 5120), 128, 264), ((5120, 8704), 16, 528),
                                              ((4096, 14336), 256, 132), ((4096, 14336), 300, 88),
                                              ((6144, 4096), 8, 660), ((5120, 1280), 64, 400),
                                              ((1792, 5120), 1, 560)])
def test_rule_is_one_wave_started_early(shape, m, programs):
    """The H200 runs (module note): one wave of programs, as many as an SM holds of the rule's
    variant times 132 SMs (5 of the halves codec's at 8 tokens, 4 at 16-64, 2 at 128), shared
    among the token blocks (128 tokens each: three at 300), at least two k-blocks each where
    that leaves 2.5 programs an SM or more (Qwen3-14B's o at TP 4 and 64 tokens: 800 steps, 400
    programs; its q/k/v at one token: 1120 steps, 560 programs); the GEMM starts with the input
    transform."""
    cfg = dw.decode_wgmma_config(random_qweight(*shape, bits=2, seed=0), m)
    assert cfg.programs == programs and cfg.dependent_launch and cfg.early_start


@pytest.mark.parametrize("shape,m,programs,early", [((5120, 1280), 16, 400, True), ((1792, 5120), 32, 528, True),
                                                    ((4096, 2048), 16, 512, True), ((4096, 1024), 8, 512, True),
                                                    ((4096, 512), 16, 256, False), ((256, 256), 8, 8, False),
                                                    ((256, 256), 16, 8, False)])
def test_rule_fills_the_wave_of_a_narrow_weight(shape, m, programs, early):
    """benchmarks/results/splitk_fill_h200/ (module note): where two k-blocks a program leave
    fewer than 2.5 programs an SM, programs of one or two k-blocks fill the wave: one program a
    step where the weight has fewer steps than a wave (Qwen3-14B's o at TP 4, 16 tokens: 400
    steps), else the wave (Qwen3-14B's q/k/v at TP 4, 32 tokens; Llama-3-8B's o at TP 2 and 4,
    8-16 tokens); under 2 an SM the GEMM starts as the input transform ends (Llama-3-8B's o at
    TP 8, 16 tokens: 256 steps; a 256 x 256 weight: 8 steps)."""
    cfg = dw.decode_wgmma_config(random_qweight(*shape, bits=2, seed=0), m)
    assert (cfg.programs, cfg.early_start) == (programs, early)


@pytest.mark.parametrize("m,rows", [(1, 1), (7, 7), (8, 8), (9, 16), (16, 16), (24, 32), (33, 48), (40, 48),
                                    (64, 64), (65, 80), (300, 304)])
def test_partial_rows_round_up_to_16_from_blocks_of_16(m, rows):
    """The GEMM's M (its partials' rows): m in the 8-token block, else m rounded up to 16, so
    that a launch never runs Triton's build for M not a multiple of 16
    (benchmarks/results/partial_rows_h200/)."""
    cfg = dw.decode_wgmma_config(random_qweight(256, 256, bits=2, seed=0), m)
    assert dw.partial_rows(m, cfg.block_tokens) == rows


def test_grid_programs_floor_and_fill():
    """grid_programs keeps two k-blocks a program while they leave 2.5 programs an SM; below,
    one wave or one program a step; starts_early splits at 2 an SM."""
    assert dw.grid_programs(10880, 5, 132, 1) == 660  # gate_up at 8 tokens: a wave
    assert dw.grid_programs(800, 4, 132, 1) == 400  # 3.03 an SM: the floor stays
    assert dw.grid_programs(560, 4, 132, 1) == 528  # 2.12 an SM under the floor: the wave
    assert dw.grid_programs(400, 4, 132, 1) == 400  # a step a program
    assert dw.grid_programs(800, 2, 132, 3) == 88  # three token blocks share the wave
    assert dw.grid_programs(1, 5, 132, 1) == 1
    assert dw.starts_early(264, 132, 1) and not dw.starts_early(263, 132, 1)
    assert dw.starts_early(88, 132, 3)


@pytest.mark.parametrize("bits", [2, 3])
def test_rule_variant_takes_the_halves_codec_at_8_tokens(bits):
    """The halves codec with one fragment at 8 tokens (1-8 tokens), measured faster than the exact
    codec's two fragments there on the H200 (K=2 0.3-6%, benchmarks/results/decode_next_ab; K=3
    6-9%, k3_cap/h200_ad46a25) and slower or level at 16-32. The configuration carries the variant."""
    qw = random_qweight(256, 512, bits=bits, seed=0)
    for m, want in ((1, (8, 1, 3, True)), (8, (8, 1, 3, True)), (9, (16, 1, 3, False)), (32, (32, 1, 3, False)),
                    (33, (64, 1, 2, False)), (200, (128, 1, 3, False))):
        assert dw.rule_variant(m, bits) == want
        cfg = dw.decode_wgmma_config(qw, m)
        assert (cfg.block_tokens, cfg.fragments, cfg.stages, cfg.halves) == want


def test_gemm_refuses_an_activation_of_the_other_codec():
    """x' of the exact order ([M, Kp]) under a halves configuration, or the halves order ([M, 2 Kp])
    under an exact one: a one-line ValueError before any launch, naming the fix."""
    qw = random_qweight(128, 256, bits=2, seed=0)
    cfg = dw.decode_wgmma_config(qw, 8)
    assert cfg.halves
    # The check reads the shape of x' only (hadamard_input's two orders: [M, Kp] and [M, 2 Kp]),
    # so the test launches nothing and runs the same with or without a GPU.
    xq = torch.zeros(8, 256, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"x' has 256 columns; .*halves=True\) reads 512"):
        dw.gemm_partials(xq, qw, cfg)
    xh = torch.zeros(8, 512, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"x' has 512 columns; .*halves=False\) reads 256"):
        dw.gemm_partials(xh, qw, dataclasses.replace(cfg, halves=False))


def _kernel_partition(programs: int, tiles: int, kblocks: int):
    """The GEMM kernel's integer arithmetic restated: for each program, its steps and, at each
    store, (tile, segment)."""
    steps = tiles * kblocks
    for p in range(programs):
        s0 = p * steps // programs
        n = (p + 1) * steps // programs - s0
        stores = []
        for i in range(n):
            tile, kb = divmod(s0 + i, kblocks)
            if kb == kblocks - 1 or i == n - 1:
                stores.append((tile, p - ((tile * kblocks + 1) * programs + steps - 1) // steps + 1))
        yield p, range(s0, s0 + n), stores


@pytest.mark.parametrize("programs,tiles,kblocks", [(528, 136, 40), (528, 40, 68), (264, 272, 40), (7, 3, 5),
                                                    (5, 5, 1), (1, 4, 9), (36, 4, 9), (132, 64, 112)])
def test_even_split_partition(programs, tiles, kblocks):
    """Every step is taken once, program lengths differ by at most one, and each tile's parts are
    stored as segments 0, 1, ... in program order, as many as segment_counts says (what the output
    transform sums): checked against a walk over the programs' step ranges."""
    taken, lengths, written = [], [], {}
    owners = [[] for _ in range(tiles)]  # the programs whose steps touch each tile, in order
    for p, steps, stores in _kernel_partition(programs, tiles, kblocks):
        taken += list(steps)
        lengths.append(len(steps))
        for t in sorted({s // kblocks for s in steps}):
            owners[t].append(p)
        for tile, seg in stores:
            assert (tile, seg) not in written
            written[(tile, seg)] = p
    assert taken == list(range(tiles * kblocks)) and max(lengths) - min(lengths) <= 1
    for t, progs in enumerate(owners):
        assert [written[(t, j)] for j in range(len(progs))] == progs
    counts = dw.segment_counts(programs, tiles, kblocks, fragments=2).tolist()
    assert counts == [len(p) for p in owners for _ in range(2)]
    assert len(written) == sum(counts[::2])


def test_pair_values_identity():
    """The mad identity _pair_values uses for the second state of a funnel word."""
    g = torch.Generator().manual_seed(0)
    t = torch.randint(0, 2**32, (1 << 16,), generator=g, dtype=torch.int64)
    mul, add = 89226354, 64248484
    sa, sb = t >> 16, t & 0xFFFF
    xa = (sa * mul + add) % 2**32
    xb = (t * mul + 1584945828 + xa * 0xFFFF0000) % 2**32
    assert 1584945828 == add * 65537 % 2**32
    assert torch.equal(xb, (sb * mul + add) % 2**32)


def test_placed_states_identity():
    """K=3 (``_states``, ``_placed``): each state shifted to the top 16 bits of a 32-bit word (a
    left shift of the word that holds it, else the window's funnel shift), then shifted down by 16
    (the codec's asm), is the window's state, for every column and window."""
    g = torch.Generator().manual_seed(1)
    v = torch.randint(-2**63, 2**63 - 1, (4096,), generator=g, dtype=torch.int64)  # 64-bit windows
    hi, lo = (v >> 32) & 0xFFFFFFFF, v & 0xFFFFFFFF

    def placed(p: int) -> torch.Tensor:  # the kernel's placement, 32 bits (p: the state's first bit in v)
        if p >= 32:
            return (hi << (48 - p)) & 0xFFFFFFFF
        if p <= 16:
            return (lo << (16 - p)) & 0xFFFFFFFF
        return (v >> (p - 16)) & 0xFFFFFFFF

    bits = 3
    kinds = set()
    for c in range(16):
        p = 48 - bits * c
        kinds.add("hi" if p >= 32 else "lo" if p <= 16 else "across")
        assert torch.equal(placed(p) >> 16, (v >> p) & 0xFFFF), c
    assert kinds == {"hi", "lo", "across"}


# Gluon kernels are compiled for sm_90a in a child process: compiling Gluon and running Triton's
# CPU interpreter in one process interfere (the interpreter patches triton.language while it runs).
_COMPILE = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from escha.kernels.decode_wgmma import PROGRAMS_PER_SM, gemm_source, register_cap, rule_variant

@gluon.jit
def layout_check(p):
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, 16])
    dot: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    gl.static_assert(gl.to_linear_layout(dot, [64, 128]) == gl.DistributedLinearLayout(
        reg_bases=REG, lane_bases=LANE, warp_bases=WARP, block_bases=[], shape=[64, 128]))

target = GPUTarget("cuda", 90, 32)
triton.compile(GluonASTSource(layout_check, {"p": "*fp16"}), target=target)
out = {}
for (bits, bn), _ in sorted(PROGRAMS_PER_SM.items()):  # the rule's variants, for their occupancy
    _, frags, stages, halves = rule_variant(bn, bits)
    cap = {"maxnreg": register_cap(bits, bn)} if register_cap(bits, bn) else {}
    k = triton.compile(gemm_source(bits, bn, stages, frags, halves=halves), target=target,
                       options={"num_warps": 4, "launch_pdl": True, **cap})
    out[f"res,{bits},{bn}"] = [k.metadata.shared, k.asm["cubin"].hex()]
    # The other kernel Triton compiles for the block: M a multiple of 16 (16-128), or M = 1 (8).
    spec = {"one_token": True} if bn == 8 else {"multiples_of_16": ("M", "Np")}
    k = triton.compile(gemm_source(bits, bn, stages, frags, halves=halves, **spec), target=target,
                       options={"num_warps": 4, "launch_pdl": True, **cap})
    out[f"spec,{bits},{bn}"] = [k.metadata.shared, k.asm["cubin"].hex()]
import dataclasses, torch
from escha.format import random_qweight
from escha.kernels.triton_compat import compile_only
from escha.kernels.decode_wgmma import decode_wgmma_config, launch_checked
qw = random_qweight(256, 1024, bits=2, seed=0)
capped = dataclasses.replace(decode_wgmma_config(qw, 64, torch.device("cuda")), max_registers=168)
with compile_only() as compiled:  # through the launcher, as a call passes the cap
    launch_checked(torch.randn(64, 1024, dtype=torch.bfloat16), qw, capped, None)
k = next(k for name, k in compiled if name == "_decode_wgmma_kernel")
out["res,cap,64"] = [k.metadata.shared, k.asm["cubin"].hex()]
for bits, bn, frags in HALVES_VARIANTS:
    out[f"halves,{bits},{bn},{frags}"] = triton.compile(gemm_source(bits, bn, 3, frags, halves=True), target=target,
                                                        options={"num_warps": 4, "launch_pdl": True}).asm["ptx"]
for bits, bn, frags, pdl in VARIANTS:
    out[f"{bits},{bn},{frags},{int(pdl)}"] = triton.compile(
        gemm_source(bits, bn, 3, frags, pdl), target=target, options={"num_warps": 4, "launch_pdl": pdl}).asm["ptx"]
json.dump(out, sys.stdout)
"""
VARIANTS = [(2, 8, 1, True), (2, 64, 1, True), (3, 16, 1, True), (2, 16, 2, True), (2, 16, 2, False)]
HALVES_VARIANTS = [(2, 8, 1), (2, 16, 2), (3, 8, 1)]  # the rule's (K=2, 8 tokens, one fragment) and two more


@pytest.fixture(scope="module")
def ptx(tmp_path_factory):
    """PTX of the GEMM for each variant (bits, tokens, fragments), compiled for sm_90a; the
    compiling process also checks that Triton's A-operand layout has the bases emulated above."""
    import json
    import os
    import subprocess
    import sys
    code = (_COMPILE.replace("REG", repr(A_REG_BASES)).replace("LANE", repr(A_LANE_BASES))
            .replace("WARP", repr(A_WARP_BASES)).replace("HALVES_VARIANTS", repr(HALVES_VARIANTS))
            .replace("VARIANTS", repr(VARIANTS)))
    script = tmp_path_factory.mktemp("sm90") / "compile_decode_wgmma.py"  # @jit needs a source file
    script.write_text(code)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # this checkout's escha
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return {tuple(v if v in ("res", "spec", "cap", "halves") else int(v) for v in k.split(",")): p
            for k, p in json.loads(run.stdout).items()}


def test_register_cap_reaches_the_compiler(ptx):
    """A configuration's ``max_registers`` is ptxas's cap: K=2 at 64 tokens builds in 205 registers
    (2 programs an SM) and capped at 168 holds 3 an SM."""
    shared, cubin = ptx[("res", "cap", 64)]
    regs = res_usage(bytes.fromhex(cubin))["REG"]
    assert regs <= 168 and programs_per_sm(regs, shared) == 3


@pytest.mark.parametrize("build", ["res", "spec"])
@pytest.mark.parametrize("bits,bn", sorted(dw.PROGRAMS_PER_SM))
def test_programs_per_sm_is_the_compiled_occupancy(ptx, bits, bn, build):
    """The rule's wave (PROGRAMS_PER_SM) is what an sm_90 SM holds of the compiled variant (at
    its register_cap): 64K registers (allocated 8 a thread at a time, 128 threads a program) and
    228 KB of shared memory (1 KB of it reserved a program). A kernel change that costs registers
    shows here. Both kernels Triton specializes on M: M other (``res``), and M = 1 (the 8-token
    block) or M a multiple of 16 (the others) (``spec``), which ptxas schedules and allocates
    otherwise (K=2 at 16 tokens uncapped: 125 registers instead of 128). The 8-token block
    launches both; the others launch only ``spec`` (``partial_rows``), and their ``res`` builds
    are held to the table too.
    Exact under the release the rule was measured with, because a wave one program an SM short of
    the capacity of the kernel launched, started early, ran 8-21% slower on the H200 than the
    same wave started late (benchmarks/results/waves_h200/; docs/KERNELS.md, "A wave short of the
    SMs' capacity"); under another release the table may hold fewer programs than fit, never more."""
    from escha.kernels.triton_compat import TRITON_RELEASE
    shared, cubin = ptx[(build, bits, bn)]
    fits = programs_per_sm(res_usage(bytes.fromhex(cubin))["REG"], shared)
    if TRITON_RELEASE == dw.MEASURED_TRITON:
        assert dw.PROGRAMS_PER_SM[(bits, bn)] == fits
    else:
        assert dw.PROGRAMS_PER_SM[(bits, bn)] <= fits


def _mmas(ptx: str) -> list[tuple[str, str]]:
    """(N, the first character of the A operand) of each fp16 wgmma: "{" for A in registers."""
    return re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16\.f32\.f16\.f16\s+\{[^}]*\},\s*(\S)", ptx)


def _expected_bytes(ptx: str) -> set[int]:
    """The byte counts the stages' mbarriers expect from their TMA copies (Triton 3.6 writes
    .shared.b64, later releases .shared::cta.b64: the same state space)."""
    return {int(v) for v in re.findall(r"mbarrier\.arrive\.expect_tx\.shared(?:::cta)?\.b64\s+_,\s*\[[^]]*\],\s*(\d+)", ptx)}


@pytest.mark.parametrize("bits,bn,frags,pdl", VARIANTS)
def test_ptx_uses_register_a_and_no_shared_stores(ptx, bits, bn, frags, pdl):
    ptx = ptx[(bits, bn, frags, int(pdl))]
    mma = _mmas(ptx)
    assert len(mma) == 8 * frags and all(int(n) == bn for n, _ in mma)
    assert all(a == "{" for _, a in mma)  # A from registers, not a shared-memory descriptor
    assert "st.shared" not in ptx  # decoded weights never go through shared memory
    assert len(re.findall(r"ld\.shared\.v4", ptx)) == 2 * frags  # 8 words a fragment: two 16-byte loads
    # Each stage's mbarrier expects exactly the bytes its TMA copies bring (else the wait hangs).
    assert _expected_bytes(ptx) == {bn * 128 * 2 + frags * 8 * 128 * 4}


@pytest.mark.parametrize("bits,bn,frags", HALVES_VARIANTS)
def test_halves_ptx_runs_two_register_a_mmas_a_fragment(ptx, bits, bn, frags):
    """The halves codec: two wgmmas a fragment and k-step (the halves of columns s and s + 8), A
    from registers, no shared-memory stores, no add.f16x2 (the tensor core sums the halves), and
    each stage's mbarrier expecting the two activation tiles and the words."""
    ptx = ptx[("halves", bits, bn, frags)]
    mma = _mmas(ptx)
    assert len(mma) == 16 * frags and all(int(n) == bn for n, _ in mma)
    assert all(a == "{" for _, a in mma)
    assert "st.shared" not in ptx and "add.f16x2" not in ptx and "add.rn.f16x2" not in ptx
    assert _expected_bytes(ptx) == {2 * bn * 128 * 2 + frags * 8 * 128 * 4}


@pytest.mark.parametrize("bits,bn,frags,pdl", VARIANTS)
def test_ptx_dependent_launch_order(ptx, bits, bn, frags, pdl):
    """With PDL only the weights' TMA copies (3 stages, each one box of every fragment's words)
    come before the wait for the input transform, and the output transform is released after the
    last MMA and the last store of partials; without, no grid-dependency instruction at all."""
    ptx = ptx[(bits, bn, frags, int(pdl))]
    if not pdl:
        assert "griddepcontrol" not in ptx
        return
    wait, release = ptx.index("griddepcontrol.wait"), ptx.index("griddepcontrol.launch_dependents")
    assert ptx.count("griddepcontrol.wait") == 1 and ptx.count("griddepcontrol.launch_dependents") == 1
    assert ptx[:wait].count("cp.async.bulk.tensor") == 3
    assert "wgmma.mma_async" not in ptx[:wait] and "st.global" not in ptx[:wait]
    assert ptx.rindex("wgmma.wait_group") < release and ptx.rindex("st.global") < release


@pytest.mark.parametrize("bits,bn,frags,pdl", VARIANTS)
def test_loop_carries_its_counters(ptx, bits, bn, frags, pdl):
    """The one 32-bit division by the k-blocks (NKB) is the program's first step into (tile,
    k-block); the loop advances that, the refill's and its ring stage as counters (a division a
    step cost about 30 instructions of the loop's ~870 at 8 tokens, offline sm_90a SASS)."""
    ptx = ptx[(bits, bn, frags, int(pdl))]
    header = ptx.index("=>This Inner Loop Header")
    assert ptx.count("div.s32") == 1 and ptx.index("div.s32") < header


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("early", [False, True])
@pytest.mark.parametrize("graph", [False, True])
def test_dependent_launch_chain(graph, early):
    """Twelve products back to back, each reading the one before it (the input transform, GEMM and
    output transform of every product launched as programmatic dependents, in a CUDA graph or
    not): bit for bit what the same chain gives with ordinary launches, and within tolerance of
    fp64. A dependent that read its producer's output before the producer finished would differ."""
    qws = [random_qweight(640, 640, bits=2 + i % 2, seed=100 + i, device="cuda") for i in range(12)]
    x0 = torch.randn(8, 640, device="cuda", dtype=torch.bfloat16)

    def chain(pdl: bool) -> torch.Tensor:
        x = x0
        for qw in qws:
            cfg = dataclasses.replace(dw.decode_wgmma_config(qw, 8, x.device), dependent_launch=pdl, early_start=early)
            x = dw.decode_wgmma(x, qw, config=cfg) * 0.5
        return x

    for qw in qws:
        dw.packed_words(qw)  # the repack happens outside the graph
    plain = chain(False)
    if graph:
        chain(True)  # compile outside the capture
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            got = chain(True)
        got.fill_(float("nan"))
        g.replay()
    else:
        got = chain(True)
    torch.cuda.synchronize()
    assert torch.equal(got, plain)
    ref = x0.double()
    for qw in qws:
        ref = (ref @ dequantize(qw).double().T) * 0.5
    assert float((got.double() - ref).norm() / ref.norm()) < 12 * 2 * (2.0**-8 + 2.0**-11)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("m", [1, 7, 33])
@pytest.mark.parametrize("head_norm", [False, True])
def test_transform_launch_shapes_give_the_rules_bits(m, head_norm):
    """The transforms' launch shapes (the input transform's blocks a program, the output
    transform's tokens and warps a program) move no bit: each element takes the same operations
    in the same order, whatever program holds it. Fresh NaN-poisoned outputs each time."""
    qw = random_qweight(640, 384, bits=2, seed=m, device="cuda")
    x = torch.randn(m, 384, device="cuda", dtype=torch.bfloat16)
    hn = None
    if head_norm:
        blocks = torch.tensor([1, 0, 1, 0, 1], dtype=torch.int8, device="cuda")
        hn = HeadNorm(torch.rand(640, device="cuda", dtype=torch.bfloat16) + 0.5, blocks, 1e-6)
    cfg = dw.decode_wgmma_config(qw, m, x.device)
    want = dw.decode_wgmma(x, qw, config=cfg, head_norm=hn, out=torch.full((m, 640), float("nan"), device="cuda",
                                                                            dtype=torch.bfloat16))
    assert torch.isfinite(want).all()
    for tokens in (1, 2, 4, 8, 16):
        for warps in (1, 2, 4):
            c2 = dataclasses.replace(cfg, output_shape=(tokens, warps))
            got = dw.decode_wgmma(x, qw, config=c2, head_norm=hn,
                                  out=torch.full((m, 640), float("nan"), device="cuda", dtype=torch.bfloat16))
            assert torch.equal(got, want), (tokens, warps)
    for blocks in (1, 2, 4):
        got = dw.decode_wgmma(x, qw, config=dataclasses.replace(cfg, input_blocks=blocks), head_norm=hn,
                              out=torch.full((m, 640), float("nan"), device="cuda", dtype=torch.bfloat16))
        assert torch.equal(got, want), blocks


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("bits", [2, 3])
@pytest.mark.parametrize("shape", [(128, 128), (300, 520), (17408, 5120)])
def test_fragments_bit_exact(bits, shape):
    qw = random_qweight(*shape, bits=bits, seed=sum(shape) + bits, device="cuda")
    got = dw.decoded_fragments(qw)
    want = dw.mma_order_core(decode_trellis(qw).to(torch.float16))
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("m", [1, 7, 8, 9, 16, 17, 32])
@pytest.mark.parametrize("bits", [2, 3])
def test_gemm_variants_within_tolerance(m, bits):
    """Both codecs at 8-32 tokens a block (the halves codec, the rule's at 8 tokens, and
    the exact one; two fragments and one; also with every program one step) write every output
    within the table's bound. The halves codec's weights are the unrounded lo + hi, within half an
    fp16 ulp of T: the table's 2**-11 weight term."""
    tol = 2 * (2.0**-8 + 2.0**-11)
    qw = random_qweight(300, 700, bits=bits, seed=m + 10 * bits, device="cuda")
    x = torch.randn(m, 700, device="cuda", dtype=torch.bfloat16)
    ref = x.double() @ dequantize(qw).double().T
    cfg = dw.decode_wgmma_config(qw, m)
    steps = qw.padded_shape[0] // 64 * (qw.padded_shape[1] // 128)  # one fragment a program
    if cfg.block_tokens > 32:
        pytest.skip("one codec above 32 tokens: test_gemm_within_tolerance")
    variants = [dataclasses.replace(cfg, halves=h, fragments=f, programs=p)
                for h in (False, True) for f in (1, 2) for p in (cfg.programs, steps // f)]
    for c in variants:
        out = torch.full((m, 300), float("nan"), device="cuda", dtype=torch.bfloat16)
        y = dw.decode_wgmma(x, qw, config=c, out=out)
        assert torch.isfinite(y).all(), c
        assert float((y.double() - ref).norm() / ref.norm()) <= tol, c


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("m", [1, 7, 8, 9, 16, 33, 64, 65, 128, 200, 256, 300])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("fragments", [1, 2])
def test_gemm_within_tolerance(m, dtype, fragments):
    tol = {torch.bfloat16: 2 * (2.0**-8 + 2.0**-11), torch.float16: 2 * (2.0**-11 + 2.0**-11),
           torch.float32: 2 * (2.0**-24 + 2.0**-11)}[dtype]
    qw = random_qweight(300, 700, bits=2 + m % 2, seed=m, device="cuda")
    x = torch.randn(m, 700, device="cuda", dtype=dtype)
    cfg = dw.decode_wgmma_config(qw, m)
    cfg = dataclasses.replace(cfg, fragments=fragments)
    y = dw.decode_wgmma(x, qw, config=cfg)
    ref = x.double() @ dequantize(qw).double().T
    assert y.dtype == dtype and y.shape == (m, 300)
    assert float((y.double() - ref).norm() / ref.norm()) <= tol
