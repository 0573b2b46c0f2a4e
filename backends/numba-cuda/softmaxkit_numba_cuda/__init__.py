"""softmaxkit-numba-cuda: the row operations of softmaxkit as Numba CUDA kernels.

The entry point names :func:`softmaxkit_numba_cuda.manifest.manifest`, which imports neither
numba nor numba.cuda; the kernels (:mod:`softmaxkit_numba_cuda.rows`) are imported by the
registry on first use.
"""

from .manifest import can_run, manifest

__all__ = ["can_run", "manifest"]
