"""Test-wide set-up, before any test module imports escha.

* Without a GPU, Triton kernels run in Triton's CPU interpreter. triton.jit reads
  TRITON_INTERPRET when a kernel is defined, so it is set here, before escha's kernels exist.
* One CPU thread (torch's intra-op pool and the BLAS under numpy, which the interpreter's dots
  use): the tests' tensors are tiny, and on a busy 2-core runner threads oversubscribe (the same
  suite took 39-52 s with one thread and 111-217 s with the default pool; a model test once ran
  25x slower).
"""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # read when the BLAS and torch's pool start

import torch  # noqa: E402

torch.set_num_threads(1)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
