"""The pipelined dequantize-once scratch filler (Hopper, Gluon): its word addressing, emulated on
the CPU; its compiled form (PTX for sm_90a: the MMAs overlap the next block's decode); and on the
GPU its scratch, bit for bit against the Triton kernel's."""
import importlib
import re
from dataclasses import replace

import pytest
import torch

from escha.format import random_qweight

dw = importlib.import_module("escha.kernels.decode_wgmma")
dqw = importlib.import_module("escha.kernels.dequant_wgmma")


def _window_offsets(n: torch.Tensor, tile: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
    """The kernel's offset (``_load_windows``) of word j of row n's window in tile ``tile`` of a
    (128-row, 128-column) block, restated with the same integer arithmetic."""
    return ((((n // 64) * 4 + (n // 16) % 4) * 2 + (n // 8) % 2) * 128 + ((n % 8) * 4 + tile // 2) * 4
            + (tile % 2) * 2 + j)


@pytest.mark.parametrize("bits", [2, 3])
def test_window_addressing_reads_every_row_window(bits):
    """Gathering pack_words at the kernel's offsets gives row_windows: every (row, tile) of every
    block, for both halves of a 128-column block (BK = 64 steps)."""
    qw = random_qweight(300, 260, bits=bits, seed=3 + bits)
    packed = dw.pack_words(qw).reshape(-1)  # [Np/128 * Kp/128 * 2048]
    want = dw.row_windows(qw.trellis, bits)  # [Np/16, Kp/16, 16, 2]
    np_, kp = qw.padded_shape
    nkb128, bk, tb = kp // 128, 64, 4
    n = torch.arange(128)[:, None, None]
    tt = torch.arange(tb)[None, :, None]
    j = torch.arange(2)[None, None, :]
    for nb in range(np_ // 128):
        for kb in range(kp // bk):
            tile = (kb * tb) % 8 + tt
            block = (nb * nkb128 + (kb * tb) // 8) * 2048
            got = packed[block + _window_offsets(n, tile, j)]  # [128, 4, 2]
            rows = nb * 128 + n[:, 0, 0]
            ref = want[rows // 16][:, kb * tb:(kb + 1) * tb][torch.arange(128), :, rows % 16]  # [128, 4, 2]
            assert torch.equal(got, ref)


def test_rule_and_refusals():
    cfg = dqw.dequant_wgmma_config(random_qweight(256, 512, bits=2, seed=0), 2048)
    assert cfg.block_k == 64 and cfg.k_per_prog == 8
    qw1 = random_qweight(64, 128, bits=1, seed=0)
    with pytest.raises(ValueError, match="handles K in"):
        dqw.dequant_hn_wgmma(qw1)


# Gluon kernels are compiled for sm_90a in a child process (see tests/test_decode_wgmma.py).
_COMPILE = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from escha.kernels.dequant_wgmma import _dequant_wgmma_kernel

out = {}
for bits, fp8, kpp in VARIANTS:
    sig = {"words_ptr": "*i32", "h_ptr": "*fp16", "scale_ptr": "*fp16", "su_ptr": "*i8", "gscale_ptr": "*fp32",
           "w_ptr": "*fp8e4nv" if fp8 else "*bf16", "wscale_ptr": "*fp32" if fp8 else "*bf16", "stride_w": "i32",
           "Np": "i32", "NKB128": "i32", "BITS": "constexpr", "BK": "constexpr", "K_PER_PROG": "constexpr",
           "OUT_FP8": "constexpr"}
    src = GluonASTSource(_dequant_wgmma_kernel, sig,
                         constexprs={"BITS": bits, "BK": 64, "K_PER_PROG": kpp, "OUT_FP8": fp8},
                         attrs={(i,): [["tt.divisibility", 16]] for i in range(8)})
    out[f"{bits},{int(fp8)},{kpp}"] = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                                     options={"num_warps": 8}).asm["ptx"]
json.dump(out, sys.stdout)
"""
VARIANTS = [(2, True, 8), (3, True, 8), (2, False, 8), (2, True, 5), (3, False, 1)]


@pytest.fixture(scope="module")
def ptx(tmp_path_factory):
    import json
    import os
    import subprocess
    import sys
    script = tmp_path_factory.mktemp("sm90") / "compile_dequant_wgmma.py"
    script.write_text(_COMPILE.replace("VARIANTS", repr(VARIANTS)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    return {tuple(int(v) for v in k.split(",")): p for k, p in json.loads(run.stdout).items()}


@pytest.mark.parametrize("bits,fp8,kpp", VARIANTS)
def test_ptx_overlaps_each_product_with_the_next_decode(ptx, bits, fp8, kpp):
    """Eight m64n64k16 products per block, A and B from shared memory; after every product but
    the last the wait leaves one group in flight (wait_group 1), and the next block's codec
    (lop3 with the 3INST mask) comes between a product's issue and the wait that retires it."""
    ptx = ptx[(bits, int(fp8), kpp)]
    mma = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n64k16\.f32\.f16\.f16\s+\{[^}]*\},\s*(\S+),\s*(\S+),", ptx)
    assert len(mma) == 8 * kpp and all(not a.startswith("{") for a, _ in mma)  # A: a descriptor
    waits = re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+)", ptx)
    assert waits == ["1"] * (kpp - 1) + ["0"]
    commits = [m.start() for m in re.finditer(r"wgmma\.commit_group", ptx)]
    wait_at = [m.start() for m in re.finditer(r"wgmma\.wait_group", ptx)]
    assert len(commits) == kpp
    for c in range(kpp - 1):
        # product c is retired by the wait that follows the issue of product c + 1; the decode of
        # block c + 1 lies between them
        between = ptx[commits[c]:wait_at[c]]
        assert "lop3.b32 xa, xa, 0x8FFF8FFF" in between
        assert commits[c + 1] < wait_at[c]
    assert ptx.count("st.global") >= kpp  # every block written


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("bits", [2, 3])
@pytest.mark.parametrize("fp8", [True, False])
@pytest.mark.parametrize("shape", [(250, 600), (17408 // 8, 5120 // 4), (1000, 1300)])
def test_scratch_bitwise_equal_to_the_triton_kernel(bits, fp8, shape):
    """Same scratch and row scales, bit for bit, as dequant_once.dequant_hn, over shapes whose k
    blocks split 5 (Kp = 640) and 8 a program; the workspace is poisoned (NaN bytes) first."""
    from escha.kernels.common import FP8_DTYPE, workspace
    from escha.kernels.dequant_once import dequant_hn
    if not dqw.runs_on(torch.device("cuda"), bits):
        pytest.skip("needs Hopper (sm_90)")
    qw = random_qweight(*shape, bits=bits, seed=11 + bits, device="cuda")
    want, want_s = dequant_hn(qw, fp8=fp8)
    want = want.clone()
    want_s = want_s.clone() if fp8 else None
    dt = FP8_DTYPE if fp8 else torch.bfloat16
    workspace(torch.device("cuda"), dt, qw.padded_shape).view(torch.uint8).fill_(0x7F if fp8 else 0xFF)
    got, got_s = dqw.dequant_hn_wgmma(qw, fp8=fp8)
    torch.cuda.synchronize()
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    if fp8:
        assert torch.equal(got_s, want_s)
    odd = dqw.dequant_hn_wgmma(qw, fp8=fp8, config=replace(dqw.dequant_wgmma_config(qw, 1), k_per_prog=3))[0]
    assert torch.equal(odd.view(torch.uint8), want.view(torch.uint8))  # 3 steps a program where they divide
