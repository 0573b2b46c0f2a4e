"""softmaxkit-cupy: CUDA C++ kernels for softmaxkit, compiled at run time through CuPy.

The backend registers itself through the ``softmaxkit.backends`` entry point
(:func:`softmaxkit_cupy.manifest.manifest`).  Importing this package imports no CuPy: the
kernels (``kernels/*.cu``) are compiled with NVRTC on first use, one module per operation
and dtype pair, and cached.  Inputs are CuPy arrays or PyTorch CUDA tensors (bfloat16 only
through PyTorch, since CuPy has no bfloat16 dtype); results come back in the caller's library
on the caller's current stream.
"""

__version__ = "0.1.0"
