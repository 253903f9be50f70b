"""Compile every kernel of escha for a CUDA target without a GPU: ``python -m escha.kernels.compile_check``.

Each op is called the way escha.matmul and the encoder call it on an NVIDIA GPU (configs from the
ops' own rules, the PTX codec), on small CPU tensors, inside ``triton_compat.compile_only``: every
launch compiles its kernel for sm_90a (Hopper, which the Gluon kernel needs) and returns without
running. Nothing is computed; the check is that the installed Triton takes every kernel, in every
variant the ops launch, through to PTX and ptxas.

Run it in a process of its own, with TRITON_INTERPRET unset (the kernels must be compiled
JITFunctions, and the stand-in driver stays Triton's active driver until the check ends).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import pkgutil
import re
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Callable, Iterator

import torch

KERNEL_SUFFIX = "_kernel"  # every launched @triton.jit / @gluon.jit function is named *_kernel


def cuobjdump(cubin: bytes, flag: str) -> str:
    """``cuobjdump FLAG`` (``-sass``, ``-res-usage``) of a cubin, with the cuobjdump Triton bundles."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, flag, f.name], capture_output=True, text=True, check=True).stdout


def res_usage(cubin: bytes) -> dict[str, int]:
    """REG, SHARED, STACK, LOCAL of the kernel in a cubin (``cuobjdump -res-usage``)."""
    return {k: int(v) for k, v in re.findall(r"\b(REG|SHARED|STACK|LOCAL):(\d+)", cuobjdump(cubin, "-res-usage"))}


def programs_per_sm(registers: int, shared: int, threads: int = 128) -> int:
    """Programs of ``threads`` threads an sm_90 SM holds: 64K registers, allocated 8 a thread at a
    time, and 228 KB of shared memory, 1 KB of it reserved a program."""
    return min(65536 // (threads * (-(-registers // 8) * 8)), 233472 // (shared + 1024))


def kernel_names() -> set[str]:
    """Names of the kernels defined in escha.kernels and the Triton encoder."""
    from triton.runtime.jit import KernelInterface  # compiled and interpreted kernels alike

    import escha.kernels
    modules = [importlib.import_module(f"escha.kernels.{m.name}") for m in pkgutil.iter_modules(escha.kernels.__path__)]
    modules.append(importlib.import_module("escha.quant.viterbi_triton"))
    names = set()
    for mod in modules:
        for name, obj in vars(mod).items():
            if (isinstance(obj, KernelInterface) and name.endswith(KERNEL_SUFFIX)
                    and getattr(obj.fn, "__module__", None) == mod.__name__):
                names.add(name)
    return names


def _launches() -> Iterator[str]:
    """Call every op in the variants a GPU run uses; yields a label before each."""
    from ..format import codebooks, random_qweight
    from ..norm import HeadNorm, RowNorm
    from ..quant.encode import Backend, EncodeOptions, encode_tiles
    from .actquant import actquant
    from .codec import CodecPath
    from .core_gemm import MIN_M
    from .decode import decode, decode_config
    from .decode_fp8 import launch_checked as decode_fp8_launch
    from .decode_fp8 import decode_fp8_config
    from .decode_fp8 import decoded_fragments as fp8_fragments
    from .decode_wgmma import launch_checked as decode_wgmma_launch
    from .decode_wgmma import decode_wgmma_config, decoded_fragments
    from .dequant import dequant_config, dequantize_core
    from .dequant_once import _dequant_once, dequant_core_bf16, dequant_core_fp8, dequant_once_config
    from .prefill import prefill, prefill_config

    cuda = torch.device("cuda")
    ptx = dict(codec=CodecPath.PTX)
    for bits in (2, 3):
        qw = random_qweight(256, 1024, bits=bits, seed=bits)
        x = lambda m, dt=torch.bfloat16: torch.randn(m, 1024).to(dt)  # noqa: E731
        for m, dt in ((1, torch.bfloat16), (8, torch.float16), (8, torch.float32), (64, torch.bfloat16)):
            yield f"decode K={bits} M={m} {dt}"
            decode(x(m, dt), qw, config=dataclasses.replace(decode_config(qw, m, cuda), **ptx))
        yield f"decode K={bits} M=8, fused output transform"
        decode(x(8), qw, config=dataclasses.replace(decode_config(qw, 8, cuda), block_n=128, split=1,
                                                    fuse_output=True, **ptx))
        for m in (1, 8, 64, 128, 256):
            yield f"decode_wgmma K={bits} M={m}"
            decode_wgmma_launch(x(m), qw, decode_wgmma_config(qw, m, cuda), None)
        yield f"decode and decode_wgmma K={bits} M=1, RMSNorms in the input and output transforms"
        norm = RowNorm(torch.ones(1024, dtype=torch.bfloat16), 1e-6)
        head = HeadNorm(torch.ones(256, dtype=torch.bfloat16), torch.ones(2, dtype=torch.int8), 1e-6)
        decode(x(1), qw, config=dataclasses.replace(decode_config(qw, 1, cuda), **ptx), norm=norm, head_norm=head)
        decode_wgmma_launch(x(1), qw, decode_wgmma_config(qw, 1, cuda), None, norm, head)
        yield f"decode_wgmma fragments K={bits}"
        decoded_fragments(qw)
        for m in (1, 100, 200):
            yield f"decode_fp8 K={bits} M={m}"
            decode_fp8_launch(x(m), qw, decode_fp8_config(qw, m, cuda), None)
        yield f"decode_fp8 K={bits} M=100, RMSNorms in the input and output transforms"
        decode_fp8_launch(x(100), qw, decode_fp8_config(qw, 100, cuda), None, norm, head)
        yield f"decode_fp8 fragments K={bits}"
        for warps_n in (1, 2):
            fp8_fragments(qw, warps_n)
        for m in (64, 256):
            yield f"prefill K={bits} M={m}"
            prefill(x(m), qw, config=dataclasses.replace(prefill_config(qw, m, cuda), **ptx))
        for fp8 in (True, False):
            yield f"dequant_{'fp8' if fp8 else 'bf16'} K={bits}"
            _dequant_once(x(128), qw, fp8, dataclasses.replace(dequant_once_config(qw, 128, cuda), **ptx), "check")
        if bits == 2:
            wide = random_qweight(256, 2560, bits=2, seed=7)
            for fp8 in (True, False):
                yield f"actquant {'fp8' if fp8 else 'bf16'}, 2560 inputs (3 tiles a row)"
                actquant(torch.randn(300, 2560, dtype=torch.bfloat16), wide, fp8=fp8)
        yield f"dequant_core_fp8 K={bits} (dequantize_core, hadamard_output_dense)"
        dequant_core_fp8(x(128), qw)
        yield f"dequant_core_fp8 K={bits} M={MIN_M} (core_gemm)"
        dequant_core_fp8(x(MIN_M), qw)
        yield f"dequant_core_bf16 K={bits}"
        dequant_core_bf16(x(128), qw)
        for dt in (torch.float16, torch.bfloat16, torch.float8_e4m3fn):
            yield f"dequantize_core K={bits} {dt}"
            dequantize_core(qw, dt, config=dataclasses.replace(dequant_config(qw, cuda), **ptx))
        yield f"viterbi K={bits}"
        encode_tiles(torch.randn(2, 256), codebooks.get("3inst").table().float(), bits,
                     EncodeOptions(backend=Backend.TRITON))


def _last_line(e: BaseException) -> str:
    lines = [line for line in str(e).strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def compile_all(arch: int = 90, log: Callable[[str], None] | None = None) -> dict[str, dict]:
    """Compile every kernel variant for CUDA ``arch``; {kernel name: {"variants", "ptx_target"}}.

    Raises RuntimeError naming the kernels the launches did not reach (a kernel added without a
    launch here) and whatever Triton raises for a kernel it cannot compile.
    """
    from .common import interpreted
    from .triton_compat import compile_only
    if interpreted():
        raise RuntimeError("TRITON_INTERPRET is set: the kernels are interpreted, not compiled; "
                           "run the check in a process without it")
    seen: dict[str, dict] = {}
    label = "setup"
    with compile_only(arch) as compiled:
        try:
            for label in _launches():  # a variant's launch runs when the next label is asked for
                if log is not None:
                    log(label)
        except Exception as e:
            raise RuntimeError(f"{label}: {type(e).__name__}: {_last_line(e)}") from e
    distinct: set[tuple[str, str]] = set()
    for name, kernel in compiled:  # a launch of an already compiled variant returns the same kernel
        if (name, kernel.hash) in distinct:
            continue
        distinct.add((name, kernel.hash))
        ptx = kernel.asm["ptx"]
        target = next((line.split()[1] for line in ptx.splitlines() if line.startswith(".target")), "?")
        entry = seen.setdefault(name, {"variants": 0, "ptx_target": target})
        entry["variants"] += 1
    missing = kernel_names() - set(seen)
    if missing:
        raise RuntimeError(f"kernels not compiled by the check (add a launch to compile_check._launches): "
                           f"{', '.join(sorted(missing))}")
    return seen


def main(argv: list[str] | None = None) -> int:
    """Compile everything; print one line per kernel (or JSON with --json); 1 on failure."""
    import triton
    p = argparse.ArgumentParser(prog="python -m escha.kernels.compile_check", description=__doc__.splitlines()[0])
    p.add_argument("--arch", type=int, default=90, help="CUDA compute capability to target (default 90: sm_90a)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    try:
        seen = compile_all(args.arch)
    except Exception as e:
        traceback.print_exc()  # Triton's compile errors point at the kernel line; keep them in CI logs
        print(f"compile_check: triton {triton.__version__}: {_last_line(e)}", file=sys.stderr)
        return 1
    seconds = time.perf_counter() - t0
    if args.json:
        print(json.dumps({"triton": triton.__version__, "arch": args.arch, "seconds": round(seconds, 1),
                          "kernels": seen}))
    else:
        for name, e in sorted(seen.items()):
            print(f"{name:<28} {e['variants']:>3} variants  {e['ptx_target']}")
        print(f"triton {triton.__version__}: {len(seen)} kernels compiled for sm_{args.arch} in {seconds:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
