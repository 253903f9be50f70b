"""Fuzzing escha.matmul: random shapes (1-600, primes included), M (1-300), dtypes, K and paths.

Every case must either match the fp32 reference within the path's tolerance or be refused with a
clear exception (TypeError/ValueError naming the problem). CI runs a few examples; the slow
test runs >= 1000 and writes a summary (benchmarks/results/fuzz_summary.json is such a run). On a
CUDA GPU ``test_fuzz_matmul_gpu`` (marked gpu) runs ESCHA_FUZZ_GPU_EXAMPLES cases (200) on the
compiled kernels, the Gluon ones the interpreter cannot run included.
"""
from __future__ import annotations

import collections
import json
import os

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings, strategies as st

import escha
from escha.format import decode_trellis, input_transform, random_qweight, row_scale
from escha.format.spec import HAD_BLOCK
from escha.ops import KernelPath, resolve_path

PRIMES = [p for p in range(2, 601) if all(p % d for d in range(2, int(p ** 0.5) + 1))]
DIM = st.one_of(st.integers(1, 600), st.sampled_from(PRIMES))
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8]
# Relative Frobenius error allowed per path (docs/KERNELS.md, tolerance table). These are
# statistical bounds: rounding errors average over the output's elements. The scale they are
# relative to is the larger of ||y|| and the product terms' quadrature sum ||q|| (``quadrature``)
# times ``few(n)``: the rounding errors' rms scales with ||q||, which ||y|| matches unless the
# terms cancel (a 1x1 weight at M=1, y near 0), and an output of few elements averages few errors
# (docs/KERNELS.md, "Small outputs").
TOL = {KernelPath.REFERENCE: 1e-5, KernelPath.DECODE: 1e-2, KernelPath.DECODE_WGMMA: 1e-2, KernelPath.DEQUANT_BF16: 2e-2,
       KernelPath.PREFILL: 8e-2, KernelPath.DEQUANT_FP8: 8e-2, KernelPath.DEQUANT_CORE_FP8: 8e-2,
       KernelPath.DEQUANT_CORE_BF16: 2e-2, KernelPath.DECODE_FP8: 8e-2}

summary: collections.Counter = collections.Counter()


def check_case(out: int, inp: int, m: int, dtype: torch.dtype, bits: int, path: str | None,
               seed: int, norm: bool = False, device: str = "cpu") -> str:
    """Run one case; return its outcome ('pass:<path>' or 'refused:<Exception>'), or fail.
    ``norm``: with an RMSNorm (weight of x's dtype) applied to x first (escha.RowNorm).
    ``device``: where the weight and x live (CUDA runs the compiled kernels, Gluon's included)."""
    qw = random_qweight(out, inp, bits, seed=seed).to(device)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(m, inp, generator=g, dtype=torch.float64)
    x = (x.to(dtype) if dtype.is_floating_point else (x * 10).to(dtype)).to(device)
    row_norm = None
    if norm and dtype.is_floating_point:
        row_norm = escha.RowNorm((torch.rand(inp, generator=g, dtype=torch.float64) + 0.5).to(dtype).to(device), 1e-6)
    try:
        y = escha.matmul(x, qw, path=path, norm=row_norm)
    except (TypeError, ValueError) as e:
        msg = str(e)
        assert len(msg) > 15, f"unclear refusal: {msg!r}"
        assert dtype not in (torch.float16, torch.bfloat16, torch.float32), f"valid input refused: {msg}"
        return f"refused:{type(e).__name__}"
    assert dtype in (torch.float16, torch.bfloat16, torch.float32), f"{dtype} accepted"
    assert y.shape == (m, out) and y.dtype == dtype
    ran = resolve_path(m, qw, path)
    if row_norm is not None:
        x = row_norm.apply(x)  # the rows the product multiplies
    ref = x.double() @ escha.dequantize(qw).double().T
    err = float((y.double() - ref).norm())
    scale = max(float(ref.norm()), few(ref.numel()) * float(quadrature(x, qw).norm()))
    tol = max(TOL[ran], 2e-3 if dtype == torch.float16 else 1e-2 if dtype == torch.bfloat16 else 0)
    assert err <= tol * scale, (f"{ran} {out}x{inp} M={m} {dtype} K={bits}: error {err:.3e} > {tol} x "
                                f"max(||y||, ||q||) = {tol * scale:.3e}")
    return f"pass:{ran.value}"


def few(n: int) -> float:
    """The normwise error of n outputs, each of rms e q_i, exceeds e ||q|| by at most this factor
    but for a chance of about 1e-6: sqrt(chi2_n(1 - 1e-6) / n) is 4.9 / 2.9 / 1.9 / 1.44 / 1.22 at
    n = 1 / 4 / 16 / 64 / 256, which 1 + 3.9 / sqrt(n) meets or exceeds at every n."""
    return 1 + 3.9 / n ** 0.5


def quadrature(x: torch.Tensor, qw) -> torch.Tensor:
    """q = |r| sqrt(Hn^2 (T^2 x'^2)): each output's product terms T_nk x'_k summed in quadrature
    through the output Hadamard (Hn^2 is blockdiag(ones(128, 128)) / 128), float64. Independent
    rounding errors of relative size e on the terms give an output error of rms e q; with random
    signs ||y|| is about ||q||, but q does not vanish where the terms cancel."""
    xp2 = input_transform(x.double(), qw).double().square()  # x'^2 [m, Kp]
    z = xp2 @ decode_trellis(qw).double().square().T  # [m, Np]
    zb = z.unflatten(-1, (-1, HAD_BLOCK)).mean(-1, keepdim=True).expand(-1, -1, HAD_BLOCK).flatten(-2)
    return (zb.sqrt() * row_scale(qw).double().abs())[:, : qw.out_features]


CASE = dict(out=DIM, inp=DIM, m=st.integers(1, 300), dtype=st.sampled_from(DTYPES),
            bits=st.sampled_from([2, 3]), path=st.sampled_from([None, "reference", "prefill", "dequant-fp8",
                                                                "dequant-core-fp8", "dequant-bf16",
                                                                "dequant-core-bf16"]),
            seed=st.integers(0, 2**20), norm=st.booleans())


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**CASE)
def test_fuzz_matmul(out, inp, m, dtype, bits, path, seed, norm):
    # CI keeps the interpreter's cost down: small M for the kernel paths.
    check_case(out, inp, min(m, 24), dtype, bits, path, seed, norm)


@pytest.mark.slow
@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**CASE)
def test_fuzz_matmul_long(out, inp, m, dtype, bits, path, seed, norm):
    # ESCHA_FUZZ_PATH=<path> runs every case on that path (a new path's own long run).
    path = os.environ.get("ESCHA_FUZZ_PATH") or path
    summary[check_case(out, inp, m, dtype, bits, path, seed, norm)] += 1
    summary["cases"] += 1
    target = os.environ.get("ESCHA_FUZZ_SUMMARY")
    if target:
        with open(target, "w") as f:
            json.dump({"device": str(torch.cuda.get_device_name(0)) if torch.cuda.is_available() else "cpu",
                       "torch": torch.__version__, "outcomes": dict(sorted(summary.items()))}, f, indent=1)


# On a CUDA GPU: the compiled kernels, the Hopper-only Gluon ones included (decode-wgmma, decode-fp8,
# which the interpreter cannot run), at M up to 300 (every decode-fp8 token block).
GPU_CASE = dict(CASE, path=st.sampled_from([None, "decode-wgmma", "decode-fp8", "prefill", "dequant-fp8",
                                            "dequant-core-fp8", "dequant-bf16", "dequant-core-bf16"]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@settings(max_examples=int(os.environ.get("ESCHA_FUZZ_GPU_EXAMPLES", "200")), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(**GPU_CASE)
def test_fuzz_matmul_gpu(out, inp, m, dtype, bits, path, seed, norm):
    if path in ("decode-wgmma", "decode-fp8") and torch.cuda.get_device_capability() != (9, 0):
        path = None  # the Hopper kernels; elsewhere the rule's choice
    outcome = check_case(out, inp, m, dtype, bits, path, seed, norm, device="cuda")
    summary[outcome] += 1
    summary["cases"] += 1
    target = os.environ.get("ESCHA_FUZZ_SUMMARY")
    if target:
        with open(target, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                       "outcomes": dict(sorted(summary.items()))}, f, indent=1)


# The plain-core path's own GEMM (kernels/core_gemm.py) runs from core_gemm.MIN_M tokens, past the
# cases above: on the CPU the rule is forced down to their few tokens; on a GPU it runs as it is.
CORE_CASE = dict(out=DIM, inp=DIM, dtype=st.sampled_from(DTYPES), bits=st.sampled_from([2, 3]),
                 seed=st.integers(0, 2**20), norm=st.booleans())


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(m=st.integers(1, 40), **CORE_CASE)
@example(out=600, inp=300, m=40, dtype=torch.bfloat16, bits=2, seed=1, norm=True)  # 15 blocks on 4 programs
def test_fuzz_core_gemm(out, inp, m, dtype, bits, seed, norm):
    from escha.kernels import dequant_once
    from escha.kernels.core_gemm import CoreGemmConfig
    cfg = CoreGemmConfig(block_m=16, block_k=64, num_warps=4, num_stages=1)  # more blocks than programs
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dequant_once, "core_gemm_config", lambda qw, m, device=None: cfg)
        check_case(out, inp, m, dtype, bits, "dequant-core-fp8", seed, norm)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@settings(max_examples=int(os.environ.get("ESCHA_FUZZ_CORE_GPU_EXAMPLES", "40")), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(m=st.integers(1024, 1300), **CORE_CASE)
def test_fuzz_core_gemm_gpu(out, inp, m, dtype, bits, seed, norm):
    from escha.kernels.core_gemm import MIN_M
    assert m >= MIN_M  # the rule's own choice runs core_gemm
    check_case(out, inp, m, dtype, bits, "dequant-core-fp8", seed, norm, device="cuda")
