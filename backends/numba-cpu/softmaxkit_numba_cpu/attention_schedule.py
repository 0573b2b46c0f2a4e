"""Dynamic sharing of attention tiles between Numba's threads: atomic counters and flags.

Each thread of the kernel's ``prange`` loop takes the next task with :func:`next_task` until
none is left, so a thread that runs faster (a core not shared with another process, lighter
causal tiles) simply takes more tasks; with a static split the whole call would wait for the
slowest thread.  Work shared by several tasks (laying out one head's keys) is done once, by
the first task that needs it (:func:`claim`); the others wait for its :func:`flag`.  All of
it runs in one parallel region: on a busy machine each region costs a wake-up of every
thread, which can take milliseconds.
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


def _flag_pointer(context, builder, signature, args):
    arr = context.make_array(signature.args[0])(context, builder, args[0])
    return cgutils.get_item_pointer(context, builder, signature.args[0], arr, [args[1]])


@intrinsic
def claim(typingctx, flags, index):
    """Atomically set ``flags[index]`` from 0 to 1; True for the one caller that did."""
    if not (isinstance(flags, types.Array) and flags.dtype == types.int64):
        return None

    def codegen(context, builder, signature, args):
        ptr = _flag_pointer(context, builder, signature, args)
        zero = context.get_constant(types.int64, 0)
        one = context.get_constant(types.int64, 1)
        pair = builder.cmpxchg(ptr, zero, one, "acq_rel", "acquire")
        return builder.extract_value(pair, 1)

    return types.boolean(flags, types.intp), codegen


@intrinsic
def flag(typingctx, flags, index):
    """``flags[index]``, read atomically (with acquire order: what was written before the
    matching :func:`set_flag` is visible after it)."""
    if not (isinstance(flags, types.Array) and flags.dtype == types.int64):
        return None

    def codegen(context, builder, signature, args):
        return builder.load_atomic(_flag_pointer(context, builder, signature, args),
                                   "acquire", 8)

    return types.int64(flags, types.intp), codegen


@intrinsic
def set_flag(typingctx, flags, index, value):
    """``flags[index] = value``, written atomically with release order."""
    if not (isinstance(flags, types.Array) and flags.dtype == types.int64):
        return None

    def codegen(context, builder, signature, args):
        value = context.cast(builder, args[2], signature.args[2], types.int64)
        builder.store_atomic(value, _flag_pointer(context, builder, signature, args),
                             "release", 8)
        return context.get_dummy_value()

    return types.void(flags, types.intp, value), codegen
