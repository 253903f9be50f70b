"""The one place that knows which Triton release is installed.

escha supports the Triton releases from ``MIN_TRITON`` to ``MAX_TRITON`` (pyproject.toml declares
the same range; CI compiles every kernel for sm_90a and runs the interpreter tests under both
ends). Where the releases differ in an API the kernels use, the switch lives here and the
kernels import the name from this module.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import tma

MIN_TRITON = (3, 6)
MAX_TRITON = (3, 9)


def _release(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


TRITON_RELEASE = _release(triton.__version__)

# Gluon's TMA load from global to shared memory: ``async_copy_global_to_shared`` up to 3.7,
# renamed ``async_load`` in 3.8; 3.9 keeps the old name only to raise an error.
tma_async_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared

# A barrier of the CTA's threads: ``thread_barrier`` in 3.6, ``barrier`` in 3.9 (which has no
# ``thread_barrier``).
cta_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier

# A shared-memory buffer viewed with another dtype, shape or layout: the private ``_reinterpret``
# in 3.6, the public ``reinterpret`` in 3.9 (which has no ``_reinterpret``). The branch is on a
# constexpr, so only the existing method is ever traced.
SMEM_REINTERPRET_PUBLIC = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))


@gluon.jit
def smem_reinterpret(buf, dtype: gl.constexpr, shape: gl.constexpr, layout: gl.constexpr):
    """``buf`` viewed as ``dtype`` [shape] in ``layout`` (the same bytes), on either release."""
    if SMEM_REINTERPRET_PUBLIC:
        return buf.reinterpret(dtype, shape, layout)
    else:
        return buf._reinterpret(dtype, shape, layout)


@contextlib.contextmanager
def compile_only(arch: int = 90) -> Iterator[list]:
    """Inside, launching a compiled (non-interpreted) kernel compiles it for CUDA ``arch`` (90:
    sm_90a) and returns without running it; no GPU or CUDA driver is needed. Yields the list of
    (kernel name, CompiledKernel) compiled so far.

    Triton resolves the target through its active driver; a stand-in driver names the target
    and the launch is turned into a warm-up (compile, no launch).
    """
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    class _TargetOnly:
        def get_current_target(self):
            return GPUTarget("cuda", arch, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

    compiled: list = []
    real_run = JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        kernel = real_run(self, *args, grid=grid, warmup=True, **kwargs)
        compiled.append((self.fn.__name__, kernel))
        return kernel

    # The previous driver is put back as it was: on a machine without a GPU there is none to
    # create, and reset_active() would try.
    previous = driver._active
    driver.set_active(_TargetOnly())
    JITFunction.run = run
    try:
        yield compiled
    finally:
        JITFunction.run = real_run
        driver._active = previous
