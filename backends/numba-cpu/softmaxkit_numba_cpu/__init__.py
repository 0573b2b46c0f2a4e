"""softmaxkit-numba-cpu: Numba kernels for the softmax family on numpy arrays and torch CPU tensors.

softmaxkit finds this backend through the ``softmaxkit.backends`` entry point, which names
:func:`softmaxkit_numba_cpu.manifest.manifest`.  Importing the package imports neither numba
nor any kernel; kernels compile on first use and are cached on disk.
"""

__version__ = "0.1.0"
