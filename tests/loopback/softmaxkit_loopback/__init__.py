"""softmaxkit-loopback: a test backend that serves a few row operations on CPU.

It is installed like any third-party backend and found through the ``softmaxkit.backends``
entry point.  Its kernels hand numpy arrays to softmaxkit's reference math, so it computes
exactly what the reference computes while exercising discovery, selection by (operation,
device, dtype), the ``can_run`` / ``should_run`` hooks, ``backend=``, ``backend_opts`` and
``softmaxkit verify``.  Its manifest sets ``requires_opt_in``: it never changes which backend
a normal call gets; prioritize it or pass ``backend="loopback"`` to use it.
"""
