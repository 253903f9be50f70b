"""``escha demo``: quantize a built-in sample matrix, report its error, check escha.matmul."""
from __future__ import annotations

import argparse
import time
import warnings

import torch

RATE_DISTORTION = {1: 0.25, 2: 0.0625, 3: 0.015625, 4: 0.00390625}  # D(R) = 2**(-2R), unit Gaussian


def sample_matrix(out_features: int = 128, in_features: int = 256, seed: int = 0) -> torch.Tensor:
    """The built-in sample: an i.i.d. unit Gaussian matrix, for which the rate-distortion bound is known."""
    return torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed))


def run(args: argparse.Namespace) -> int:
    """Quantize, report relative MSE against D(R), then run escha.matmul and gate it on the reference."""
    import escha
    from escha.format import matmul_reference
    from escha.ops import resolve_path

    w = sample_matrix(args.out_features, args.in_features, args.seed)
    t0 = time.perf_counter()
    # progress=None: a bar on a terminal when the encode takes more than a moment, and a note
    # before one that takes long (a large --out-features on a CPU).
    qw = escha.quantize(w, bits=args.bits, seed=args.seed, encoder=args.encoder, progress=None)
    t_quant = time.perf_counter() - t0
    mse = float((escha.dequantize(qw) - w).pow(2).mean() / w.pow(2).mean())
    print(f"sample: {list(w.shape)} i.i.d. N(0,1), K={args.bits}, {args.encoder} encoder, "
          f"{qw.bits_per_weight:.4f} bits/weight stored")
    print(f"quantized in {t_quant:.2f} s; relative MSE {mse:.4f} "
          f"(rate-distortion bound {RATE_DISTORTION[args.bits]:.4f}, ratio {mse / RATE_DISTORTION[args.bits]:.2f})")

    device = "cuda" if torch.cuda.is_available() else "cpu"
    qd = qw.to(device)
    x = torch.randn(args.m, args.in_features, generator=torch.Generator().manual_seed(args.seed + 1))
    x = x.to(device=device, dtype=torch.bfloat16 if device == "cuda" else torch.float16)
    path = resolve_path(args.m, qd)
    with warnings.catch_warnings():
        # Triton's CPU interpreter casts masked-off lanes too and warns about their NaNs.
        warnings.filterwarnings("ignore", category=RuntimeWarning, module="triton.runtime.interpreter")
        y = escha.matmul(x, qd)
    ref = matmul_reference(x.float(), qd)
    rel = float((y.float() - ref).norm() / ref.norm())
    # fp8 operands (prefill paths) carry ~2**-4 relative rounding, bf16 2**-8, fp16 2**-11;
    # errors average down over the K-long dot products, so these bounds hold with margin.
    tol = 6e-2 if path.fp8_operands else 2e-2 if x.dtype == torch.bfloat16 else 5e-3
    ok = bool(torch.isfinite(y).all()) and rel <= tol
    print(f"escha.matmul on {device} ({x.dtype}, M={args.m}, path {path.value}{_how(path, device)}): "
          f"relative error {rel:.2e} vs reference, tolerance {tol:.0e}: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


def _how(path, device: str) -> str:
    """How the path ran, where that is not a compiled GPU kernel."""
    from escha.kernels.common import interpreted
    from escha.ops import KernelPath
    if path == KernelPath.REFERENCE:
        return ", the PyTorch reference codec"
    if device == "cpu" and interpreted():  # the demo turns the interpreter on when there is no GPU
        return ", its Triton kernel in Triton's CPU interpreter"
    return ""


def positive_int(text: str) -> int:
    """argparse type: an integer of at least 1 (an empty matrix or batch has nothing to check)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``escha demo``."""
    p = sub.add_parser("demo", help="quantize a built-in sample matrix and check escha.matmul",
                       description=run.__doc__)
    p.add_argument("--bits", type=int, default=2, choices=(1, 2, 3, 4),
                   help="K, bits per weight of the trellis code (default 2)")
    # 128 tiles: a few seconds for the exact Viterbi encoder on a 2-core CPU, instant on a GPU.
    p.add_argument("--out-features", type=positive_int, default=128,
                   help="rows of the sample matrix (default 128)")
    p.add_argument("--in-features", type=positive_int, default=256,
                   help="columns of the sample matrix (default 256)")
    p.add_argument("--m", type=positive_int, default=8,
                   help="activation rows multiplied by the quantized matrix (default 8)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the sample matrix, the activations and the sign vectors (default 0)")
    p.add_argument("--encoder", choices=("viterbi", "greedy"), default="viterbi",
                   help="trellis encoder: exact tail-biting Viterbi (default) or the greedy baseline")
    p.set_defaults(func=run)
