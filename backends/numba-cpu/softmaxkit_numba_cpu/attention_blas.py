"""Matrix products for the compiled attention kernels: BLAS ``sgemm`` / ``dgemm`` from Numba.

:func:`gemm` is the product Numba's own ``np.dot`` makes (Numba's C helper ``numba_xxgemm``,
which calls SciPy's BLAS through ``scipy.linalg.cython_blas``), without its restrictions: the
operands are sub-blocks of larger C-contiguous arrays (a base pointer, an element offset and a
leading dimension), either operand may be transposed, and ``beta`` lets a product accumulate
into its output, so ``O += P V`` needs no temporary.  Compiled calls resolve the helper by
name, so the kernels that use it are cached on disk like any other.

The products run on whatever threads SciPy's OpenBLAS has; the attention wrapper limits it to
one thread while Numba's threads run the kernels (:mod:`.attention`).
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

_CHAR = ir.IntType(8)
_VOIDP = ir.IntType(8).as_pointer()


@intrinsic
def gemm(typingctx, trans_a, trans_b, m, n, k, alpha, a, a_off, lda, b, b_off, ldb, beta, c,
         c_off, ldc):
    """Row-major ``C = alpha op(A) op(B) + beta C`` on blocks of C-contiguous arrays.

    ``op(A)`` is ``[m, k]``: the block of ``a`` starting at flat element ``a_off`` with row
    stride ``lda``, read as ``[m, k]`` (``trans_a == 0``) or as the transpose of a ``[k, m]``
    block (``trans_a == 1``); likewise ``op(B)`` is ``[k, n]`` from ``b``, and ``C`` is the
    ``[m, n]`` block of ``c`` at ``c_off`` with row stride ``ldc``.  ``trans_a`` and
    ``trans_b`` must be compile-time literals.  The three arrays share one dtype, float32
    or float64.  Returns the helper's status (0 on success).
    """
    dtype = c.dtype if isinstance(c, types.Array) else None
    if dtype not in (types.float32, types.float64) or a.dtype != dtype or b.dtype != dtype:
        return None
    if not all(isinstance(t, types.IntegerLiteral) for t in (trans_a, trans_b)):
        return None
    ta, tb = bool(trans_a.literal_value), bool(trans_b.literal_value)
    kind = ord("s") if dtype == types.float32 else ord("d")

    def codegen(context, builder, signature, args):
        (_, _, m_, n_, k_, alpha_, a_, aoff, lda_, b_, boff, ldb_, beta_, c_, coff, ldc_) = args
        at, bt, ct = signature.args[6], signature.args[9], signature.args[13]
        intp = context.get_value_type(types.intp)

        def data(ty, value, off):
            arr = context.make_array(ty)(context, builder, value)
            return builder.bitcast(builder.gep(arr.data, [off]), _VOIDP)

        def slot(ty, value):
            v = context.cast(builder, value, ty, dtype)
            return builder.bitcast(cgutils.alloca_once_value(builder, v), _VOIDP)

        def size(ty, value):
            return context.cast(builder, value, ty, types.intp)

        sig = signature.args
        fnty = ir.FunctionType(ir.IntType(32), [
            _CHAR, _CHAR, _CHAR, intp, intp, intp, _VOIDP, _VOIDP, intp, _VOIDP, intp, _VOIDP,
            _VOIDP, intp,
        ])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "numba_xxgemm")
        # column-major BLAS sees each row-major block transposed: C^T = op(B)^T op(A)^T
        char = lambda flag: ir.Constant(_CHAR, ord("t") if flag else ord("n"))  # noqa: E731
        return builder.call(fn, [
            ir.Constant(_CHAR, kind), char(tb), char(ta),
            size(sig[3], n_), size(sig[2], m_), size(sig[4], k_),
            slot(sig[5], alpha_),
            data(bt, b_, size(sig[10], boff)), size(sig[11], ldb_),
            data(at, a_, size(sig[7], aoff)), size(sig[8], lda_),
            slot(sig[12], beta_),
            data(ct, c_, size(sig[14], coff)), size(sig[15], ldc_),
        ])

    sig = types.int32(trans_a, trans_b, m, n, k, alpha, a, a_off, lda, b, b_off, ldb, beta, c,
                      c_off, ldc)
    return sig, codegen
