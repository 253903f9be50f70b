"""Test-wide set-up, before any test module imports escha.

* Without a GPU, Triton kernels run in Triton's CPU interpreter. triton.jit reads
  TRITON_INTERPRET when a kernel is defined, so it is set here, before escha's kernels exist.
* One CPU thread (torch's intra-op pool and the BLAS under numpy, which the interpreter's dots
  use): the tests' tensors are tiny, and on a busy 2-core runner threads oversubscribe (the same
  suite took 39-52 s with one thread and 111-217 s with the default pool; a model test once ran
  25x slower).
* Each test starts with Triton's language namespaces as they were before any kernel ran (the
  interpreter leaves some of them patched: the note above the fixture).
"""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # read when the BLAS and torch's pool start

import torch  # noqa: E402

torch.set_num_threads(1)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import triton.language as _tl  # noqa: E402

# Triton's CPU interpreter (3.6 to 3.9) patches triton.language.core's builtins with its own when a
# jit helper of an interpreted kernel calls one of Triton's own jit functions (common._bit_partner,
# the butterflies' partner fetch, calls tl.sum), and does not restore them:
# InterpretedFunction.__call__ opens a patch scope over the callee's modules and never closes it.
# A later offline compile in the same process (the Gluon kernels' and probes' sm_90a PTX tests)
# then builds tensor.to and scalar broadcasts with the interpreter's builder and fails, unless
# Triton's cache already holds the kernel. Each test starts from the namespaces as they were before
# any kernel ran.
_NAMESPACES = (_tl.core, _tl.core.tensor, _tl.core.tensor_descriptor_base, _tl.math)
_PRISTINE = [dict(vars(ns)) for ns in _NAMESPACES]


@pytest.fixture(autouse=True)
def _triton_language_unpatched():
    yield
    for ns, pristine in zip(_NAMESPACES, _PRISTINE):
        now = vars(ns)
        for name in [n for n in now if n not in pristine]:
            delattr(ns, name)
        for name, value in pristine.items():
            if now.get(name) is not value:
                setattr(ns, name, value)
