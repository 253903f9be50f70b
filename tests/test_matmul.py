"""escha.matmul on every path: accuracy against fp32 x @ W_hat^T, poisoned outputs, validation, NaN.

Tolerances (relative Frobenius error; derivation in docs/KERNELS.md, ## Prefill):
    e4m3 rounds each operand element with relative error |d| <= u = 2**-4, rms u/sqrt(3) = 0.036;
    a product of two rounded operands has rms error sqrt(2) * 0.036 = 0.051 per term, and for sums
    of many independently-rounded terms the normwise error of the result is that rms (errors do
    not add coherently). bf16 (u = 2**-8): sqrt(2) * 0.0023 = 0.0032 per term; the output's own
    rounding adds one more term of its dtype. The decode paths (decode, decode-wgmma) multiply
    fp16 operands: x' rounded once to fp16 (u = 2**-11), T exact in fp16 (docs/KERNELS.md,
    Tolerance table), which the two-operand term covers. Bounds below carry a 1.2-1.5x margin; a
    wrong kernel (swapped tile, missing transform, wrong scale) is off by O(1).
"""
import pytest
import torch

import escha
from escha.format import dequantize, random_qweight
from escha.ops import KernelPath, check_inputs

DEV = "cuda" if torch.cuda.is_available() else "cpu"
U = {"fp8": 2.0 ** -4, "bf16": 2.0 ** -8, "fp16": 2.0 ** -11, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8,
     torch.float32: 2.0 ** -24}


def bound(path: KernelPath, out_dtype: torch.dtype) -> float:
    """Normwise relative error bound: operand rounding (per path) plus output rounding, 1.5x margin."""
    out = U[out_dtype] / 3 ** 0.5
    if path == KernelPath.REFERENCE:
        return 1.5 * out + 1e-5
    op = U["fp8" if path.fp8_operands else "fp16" if path in (KernelPath.DECODE, KernelPath.DECODE_WGMMA) else "bf16"]
    # The plain-core paths also round the GEMM's output z to bf16 before the output transform.
    mid = U[torch.bfloat16] / 3 ** 0.5 if path in (KernelPath.DEQUANT_CORE_FP8, KernelPath.DEQUANT_CORE_BF16) else 0.0
    return 1.5 * ((2 ** 0.5 * op / 3 ** 0.5) ** 2 + mid ** 2 + out ** 2) ** 0.5 + 1e-5


TOLERANCE_TABLE = {(p, d): bound(p, d) for p in KernelPath for d in (torch.float16, torch.bfloat16, torch.float32)}


def rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.fixture(scope="module")
def qw():
    return random_qweight(140, 200, 2, seed=7, device=DEV)


@pytest.fixture(scope="module")
def w_exact(qw):
    return dequantize(qw)


def test_tolerance_table_values():
    assert TOLERANCE_TABLE[(KernelPath.PREFILL, torch.bfloat16)] == pytest.approx(0.077, abs=0.002)
    assert TOLERANCE_TABLE[(KernelPath.DECODE_FP8, torch.bfloat16)] == pytest.approx(0.077, abs=0.002)
    assert TOLERANCE_TABLE[(KernelPath.DEQUANT_BF16, torch.bfloat16)] < 0.01
    # fp16 operands: within docs/KERNELS.md's decode table (2 (u_out + 2**-11)), far below fp8's.
    for path in (KernelPath.DECODE, KernelPath.DECODE_WGMMA):
        for dtype, table in ((torch.float32, 9.8e-4), (torch.float16, 1.95e-3), (torch.bfloat16, 8.8e-3)):
            assert TOLERANCE_TABLE[(path, dtype)] < table


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_decode_accuracy(qw, w_exact, dtype):
    """The portable decode kernel (fp16 operands) within its bound, at the rule's decode range."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 20, 200, generator=g).to(DEV, dtype)  # M = 40
    y = escha.matmul(x, qw, path=KernelPath.DECODE)
    assert y.shape == (2, 20, 140) and y.dtype == dtype
    err = rel(y, x.float() @ w_exact.T)
    assert err < TOLERANCE_TABLE[(KernelPath.DECODE, dtype)], f"decode {dtype}: {err:.3e}"


@pytest.mark.parametrize("path", [KernelPath.REFERENCE, KernelPath.PREFILL, KernelPath.DEQUANT_FP8,
                                  KernelPath.DEQUANT_CORE_FP8, KernelPath.DEQUANT_BF16, KernelPath.DEQUANT_CORE_BF16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_paths_accuracy(qw, w_exact, path, dtype):
    g = torch.Generator().manual_seed(hash((path.value, str(dtype))) % 2**31)
    x = torch.randn(3, 45, 200, generator=g).to(DEV, dtype)  # leading dims flatten to M = 135
    y = escha.matmul(x, qw, path=path)
    assert y.shape == (3, 45, 140) and y.dtype == dtype
    ref = x.float() @ w_exact.T
    err = rel(y, ref)
    assert err < TOLERANCE_TABLE[(path, dtype)], f"{path} {dtype}: {err:.3e}"


def test_fp8_paths_are_not_exact(qw, w_exact):
    """The fp8 error is real rounding, not a bug hiding behind a loose bound: it sits near the
    predicted 0.051 and well above bf16's."""
    x = torch.randn(130, 200, device=DEV, dtype=torch.bfloat16)
    ref = x.float() @ w_exact.T
    e8 = rel(escha.matmul(x, qw, path="prefill"), ref)
    e16 = rel(escha.matmul(x, qw, precision="bf16"), ref)
    assert 0.015 < e8 < 0.077 and e16 < 0.25 * e8


def test_prefill_writes_every_output(qw, w_exact):
    """Poisoned output buffer: the fused kernel must overwrite every element (ragged M and N)."""
    from escha.kernels import prefill
    x = torch.randn(77, 200, device=DEV, dtype=torch.float16)
    y = torch.full((77, 140), float("nan"), device=DEV, dtype=torch.float16)
    prefill(x, qw, out=y)
    assert torch.isfinite(y).all()
    assert rel(y, x.float() @ w_exact.T) < TOLERANCE_TABLE[(KernelPath.PREFILL, torch.float16)]


@pytest.mark.parametrize("path", [KernelPath.REFERENCE, KernelPath.PREFILL, KernelPath.DEQUANT_FP8,
                                  KernelPath.DEQUANT_CORE_FP8, KernelPath.DEQUANT_BF16, KernelPath.DEQUANT_CORE_BF16])
def test_nonfinite_rows_propagate(qw, w_exact, path):
    x = torch.randn(70, 200, device=DEV, dtype=torch.bfloat16)
    x[4, 10] = float("nan")
    x[9, 0] = float("inf")
    y = escha.matmul(x, qw, path=path)
    ref = x.float() @ w_exact.T  # torch.matmul: rows 4 and 9 are non-finite
    bad = ~torch.isfinite(ref).all(1)
    assert bad.tolist() == (~torch.isfinite(y.float()).all(1)).tolist()
    assert (~torch.isfinite(y[4])).all() and (~torch.isfinite(y[9])).all()
    good = ~bad
    assert rel(y[good], ref[good]) < TOLERANCE_TABLE[(path, torch.bfloat16)]


def test_validation_errors(qw):
    with pytest.raises(TypeError, match="dtype"):
        escha.matmul(torch.ones(2, 200, dtype=torch.int32, device=DEV), qw)
    with pytest.raises(ValueError, match="inner dimension 199"):
        escha.matmul(torch.randn(2, 199, device=DEV), qw)
    with pytest.raises(TypeError, match="QuantizedWeight"):
        escha.matmul(torch.randn(2, 200, device=DEV), "not a weight")
    with pytest.raises(ValueError, match="unknown path"):
        escha.matmul(torch.randn(2, 200, device=DEV), qw, path="fastest")
    with pytest.raises(ValueError, match="unknown precision"):
        escha.matmul(torch.randn(2, 200, device=DEV), qw, precision="int4")
    with pytest.raises(TypeError, match="path must be None, a KernelPath or one of"):
        escha.matmul(torch.randn(2, 200, device=DEV), qw, path=["decode"])
    with pytest.raises(TypeError, match="precision must be a Precision or one of"):
        escha.matmul(torch.randn(2, 200, device=DEV), qw, precision=["fp8"])
    for requires_grad in (False, True):  # checked before any work, on the op's way or not
        with pytest.raises(TypeError, match="rule must be an escha.DispatchRule or None, got str"):
            escha.matmul(torch.randn(2, 200, device=DEV, requires_grad=requires_grad), qw, rule="x")
    if DEV == "cpu":
        with pytest.raises(ValueError, match="is on"):
            check_inputs(torch.randn(2, 200), qw.to("meta"))


def test_empty_rows(qw):
    y = escha.matmul(torch.randn(0, 200, device=DEV), qw, path="prefill")
    assert y.shape == (0, 140)


def _grad_check(x: torch.Tensor, qw, w_exact: torch.Tensor, path) -> float:
    """x.grad of escha.matmul against fp64 autograd of x @ W_hat^T, for one random upstream gradient."""
    x = x.detach().requires_grad_(True)
    y = escha.matmul(x, qw, path=path)
    assert y.requires_grad
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(y.device, y.dtype)
    y.backward(g)
    x64 = x.detach().double().requires_grad_(True)
    (x64 @ w_exact.double().T).backward(g.double())
    assert x.grad.dtype == x.dtype and x.grad.shape == x.shape
    return float((x.grad.double() - x64.grad).norm() / x64.grad.norm())


@pytest.mark.parametrize("shape", [(140, 200), (33, 257), (256, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", [KernelPath.REFERENCE, None])
def test_gradient_with_respect_to_x(shape, dtype, path):
    """grad_x = grad_y @ W_hat, whichever path ran the forward (None: the rule's, a decode kernel at
    M = 10): the product is fp32 and exact up to the one rounding to x's dtype, 2 u_out relative."""
    qw = random_qweight(*shape, 2, seed=shape[0])
    x = torch.randn(2, 5, shape[1], generator=torch.Generator().manual_seed(0)).to(DEV, dtype)
    err = _grad_check(x, qw.to(DEV), dequantize(qw.to(DEV)), path)
    assert err < (2 * U[dtype] if dtype != torch.float32 else 1e-5), err


def test_gradient_on_a_prefill_path(qw, w_exact):
    """A kernel path past the decode range: the forward's fp8 rounding does not reach the gradient."""
    err = _grad_check(torch.randn(70, 200, device=DEV), qw, w_exact, KernelPath.DEQUANT_CORE_FP8)
    assert err < 1e-5, err


def test_quantized_weight_gets_no_gradient(qw):
    """The weight is frozen: a weight whose scales require grad leaves them without one."""
    scale = qw.scale.clone().requires_grad_(True)
    frozen = type(qw).trusted([qw.trellis, qw.su, qw.sv, scale, qw.gscale], qw.shape, qw.bits)
    x = torch.randn(3, 200, device=DEV, requires_grad=True)
    escha.matmul(x, frozen, path="reference").sum().backward()
    assert x.grad is not None and scale.grad is None


@pytest.mark.parametrize("shape,run_weights", [((300, 200), 1), ((300, 200), 2 * 128 * 256), ((640, 130), 3 * 128 * 256)])
def test_backward_decodes_whole_row_block_runs(shape, run_weights):
    """The backward decodes the core T run by run (memory) and multiplies in the transform domain:
    each run of 128-row blocks decodes to exactly those rows of the whole weight's T, and the
    products by runs equal the products by the whole W_hat within fp32's rounding (the Hadamards'
    sums of 128 terms and the runs' summation order)."""
    from escha.format.codec import decode_trellis
    from escha.ops import _row_runs, _times_w, _times_wt
    qw = random_qweight(*shape, 2, seed=shape[0] + run_weights).to(DEV)
    runs = list(_row_runs(qw, run_weights))
    assert len(runs) > 1 and [r[0] for r in runs[1:]] == [r[1] for r in runs[:-1]]
    assert runs[0][0] == 0 and runs[-1][1] == qw.padded_shape[0]
    decoded = torch.cat([torch.ops.escha.decode_core(*args) for _, _, args in runs])
    assert decoded.dtype == torch.float16 and torch.equal(decoded, decode_trellis(qw))
    whole = dequantize(qw).double()
    g = torch.randn(7, shape[0], device=DEV)
    h = torch.randn(7, shape[1], device=DEV)
    for got, want in ((_times_w(g, qw, run_weights), g.double() @ whole),
                      (_times_wt(h, qw, run_weights), h.double() @ whole.T)):
        assert got.dtype == torch.float32 and got.shape == want.shape
        assert float((got.double() - want).norm() / want.norm()) < 1e-6


def test_backward_run_size_follows_the_device():
    """Without a size, a run holds at most the device's BACKWARD_RUN_WEIGHTS padded weights in
    whole 128-row blocks, and one block where a single block is larger."""
    from escha.ops import BACKWARD_RUN_WEIGHTS, _row_runs
    qw = random_qweight(1300, 700, 2, seed=5).to(DEV)  # 11 blocks of 128 x 768 padded weights
    per_block = 128 * qw.padded_shape[1]
    cap = BACKWARD_RUN_WEIGHTS[qw.device.type]
    sizes = [r1 - r0 for r0, r1, _ in _row_runs(qw)]
    want = max(1, cap // per_block) * 128
    assert sizes[:-1] == [want] * (len(sizes) - 1) and sum(sizes) == qw.padded_shape[0]
    assert [r1 - r0 for r0, r1, _ in _row_runs(qw, per_block - 1)] == [128] * 11
    assert [r1 - r0 for r0, r1, _ in _row_runs(qw, 3 * per_block)] == [384, 384, 384, 256]
