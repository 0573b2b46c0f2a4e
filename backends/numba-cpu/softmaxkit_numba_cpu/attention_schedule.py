"""Dynamic sharing of attention tiles between Numba's threads: an atomic task counter.

Each thread of the kernel's ``prange`` loop takes the next task with
:func:`next_task` until none is left, so a thread that runs faster (a core not shared with
another process, lighter causal tiles) simply takes more tasks; with a static split the
whole call would wait for the slowest thread.
"""

from __future__ import annotations

from numba import types
from numba.core import cgutils
from numba.extending import intrinsic


@intrinsic
def next_task(typingctx, counter):
    """Atomically increment ``counter[0]`` (an int64 array) and return its previous value."""
    if not (isinstance(counter, types.Array) and counter.dtype == types.int64):
        return None

    def codegen(context, builder, signature, args):
        arr = context.make_array(signature.args[0])(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, signature.args[0], arr,
                                       [context.get_constant(types.intp, 0)])
        one = context.get_constant(types.int64, 1)
        return builder.atomic_rmw("add", ptr, one, "monotonic")

    return types.int64(counter), codegen
