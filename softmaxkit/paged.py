"""Attention against a paged KV cache: decoding and chunked prefill (``paged_attention``).

The frontend validates the cache's metadata (block table and sequence lengths) before any
backend runs, so a kernel never meets a page index outside the pool or a length beyond a
sequence's pages; then it hands the backend one call in the layout of
:data:`softmaxkit.ops.OPERATIONS`.  Host arrays are checked on the host; the metadata of an
accelerator is checked where it lives, with one boolean read back, and copied to the host only
to name the fault of wrong metadata.  spec/semantics.md, "Paged attention", is the contract.
"""

from __future__ import annotations

from typing import Any

import array_api_compat
import numpy as np

from . import arguments as args
from .attention import lse_in_base
from .dispatch import run
from .dtypes import dtype_name
from .frameworks import refuse_gradient, route
from .metadata import host_integers, index_array


def _causal(causal: Any) -> str | None:
    """``causal`` of paged attention: only the bottom-right alignment exists here."""
    aligned = args.causal(causal)
    if aligned == "top_left":
        raise ValueError(
            "causal='top_left' is not valid for paged_attention: the queries are the last Lq "
            "positions of each sequence, so causal attention is bottom-right aligned "
            "(pass causal=True)"
        )
    return aligned


def check_shapes(q: Any, k_pages: Any, v_pages: Any, block_table: Any, seqlens: Any) -> None:
    if q.ndim != 4:
        raise ValueError(f"q must have shape [B, Hq, Lq, D]; got {tuple(q.shape)}")
    for name, a, last in (("k_pages", k_pages, "D"), ("v_pages", v_pages, "Dv")):
        if a.ndim != 4:
            raise ValueError(
                f"{name} must have shape [P, Hk, page_size, {last}]; got {tuple(a.shape)}"
            )
    b, hq, _, d = q.shape
    pages, hk, page_size, dk = k_pages.shape
    if dk != d:
        raise ValueError(f"q's head dim {d} differs from k_pages' {dk}")
    if tuple(v_pages.shape[:3]) != (pages, hk, page_size):
        raise ValueError(
            f"v_pages of shape {tuple(v_pages.shape)} must be [P, Hk, page_size, Dv] with "
            f"(P, Hk, page_size) = {(pages, hk, page_size)} from k_pages"
        )
    args.grouped_query_heads(hq, hk, "k_pages' and v_pages'")
    if block_table.ndim != 2 or block_table.shape[0] != b:
        raise ValueError(
            f"block_table of shape {tuple(block_table.shape)} must have shape "
            f"[B, max_pages] with B = {b} from q"
        )
    if tuple(seqlens.shape) != (b,):
        raise ValueError(f"seqlens of shape {tuple(seqlens.shape)} must have shape ({b},)")


def _check_metadata(
    table: np.ndarray, lens: np.ndarray, pages: int, page_size: int
) -> None:
    """Lengths within each sequence's pages, and every page a sequence uses in the pool
    (``table`` and ``lens`` are the host int64 values)."""
    max_pages = table.shape[1]
    bad = np.flatnonzero(lens < 0)
    if bad.size:
        b = int(bad[0])
        raise ValueError(f"seqlens[{b}] = {int(lens[b])} is negative")
    capacity = max_pages * page_size
    bad = np.flatnonzero(lens > capacity)
    if bad.size:
        b = int(bad[0])
        raise ValueError(
            f"seqlens[{b}] = {int(lens[b])} exceeds the keys its pages can hold: block_table "
            f"has {max_pages} pages of page_size {page_size} per sequence ({capacity} keys)"
        )
    if not table.size:
        return
    # entries outside [0, pages) in one pass (a negative int64 viewed as uint64 is >= 2**63);
    # a row is wrong when its first such entry lies among the pages it uses, the first
    # ceil(seqlens[b] / page_size) entries of the row
    outside = table.view(np.uint64) >= pages
    first = outside.argmax(axis=1)
    rows = np.arange(table.shape[0])
    wrong = outside[rows, first] & (first * page_size < lens)
    if wrong.any():
        b = int(np.flatnonzero(wrong)[0])
        j = int(first[b])
        raise ValueError(
            f"block_table[{b}, {j}] = {int(table[b, j])} is outside the page pool [0, {pages}) "
            f"(sequence {b} of length {int(lens[b])} uses its first "
            f"{-(-int(lens[b]) // page_size)} pages)"
        )


def _valid_on_device(xp: Any, table: Any, lens: Any, pages: int, page_size: int) -> bool:
    """True when the metadata is not host memory and passes :func:`_check_metadata` where it
    lives; False sends the caller to the host check (host and Dask arrays, values a compiler
    traces, and wrong metadata, whose first fault the host check names).

    A decode step's block table is large (``B * max_pages`` entries) and lives on the
    accelerator: reducing it there and reading back one boolean costs a few small kernels and
    one synchronization, where copying it to the host costs its transfer and a host pass
    while the device idles.
    """
    if isinstance(table, np.ndarray) and isinstance(lens, np.ndarray):
        return False
    if array_api_compat.is_dask_array(table) or array_api_compat.is_dask_array(lens):
        return False  # the host check computes each graph once
    capacity = table.shape[1] * page_size
    try:
        index = xp.int64 if capacity >= 2**31 else lens.dtype  # JAX has no int64 by default
        starts = xp.arange(0, capacity, page_size, dtype=index,
                           device=array_api_compat.device(table))
        used = starts[None, :] < xp.astype(lens, index, copy=False)[:, None]  # ceil(len/S) pages
        outside = (table < 0) | (table >= pages)
        bad = xp.any((lens < 0) | (lens > capacity)) | xp.any(outside & used)
        return not bool(bad)
    except Exception:  # a traced value has no boolean: the host read names the argument
        return False


def paged_attention(
    q: Any,
    k_pages: Any,
    v_pages: Any,
    block_table: Any,
    seqlens: Any,
    *,
    scale: float | None = None,
    causal: bool | str = False,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    return_lse: bool = False,
    lse_base: str | int = "e",
    precision: str = "float32",
    check_metadata: bool = True,
    backend: str | None = None,
) -> Any:
    """Exact attention of new queries against a paged KV cache (decoding, chunked prefill).

    Sequence ``b`` has ``seqlens[b]`` keys: key ``j`` is slot ``j % page_size`` of page
    ``block_table[b, j // page_size]`` of the pool.  Its ``Lq`` queries are the *last* ``Lq``
    positions of the sequence (their own keys included in ``seqlens``), so query ``i`` sits on
    key ``seqlens[b] - Lq + i``: the bottom-right alignment of :func:`softmaxkit.attention`,
    per sequence.  The result equals :func:`softmaxkit.attention` on each sequence's gathered
    keys and values.

    Parameters
    ----------
    q : array
        Queries ``[B, Hq, Lq, D]``; ``Lq = 1`` for decoding.
    k_pages : array
        The key page pool ``[P, Hk, page_size, D]``; ``Hq`` must be a multiple of ``Hk``
        (grouped-query attention).
    v_pages : array
        The value page pool ``[P, Hk, page_size, Dv]``.
    block_table : array of int32 or int64
        ``[B, max_pages]``: the pages of each sequence, in order.  Only the first
        ``ceil(seqlens[b] / page_size)`` entries of row ``b`` are read; the rest may hold
        anything (-1 as padding, say).
    seqlens : array of int32 or int64
        ``[B]``: the number of keys of each sequence, the ``Lq`` new ones included;
        ``0 <= seqlens[b] <= max_pages * page_size``.  Cache slots at or beyond a sequence's
        length are never read.
    scale : float, optional
        Score scale; default ``1 / sqrt(D)``.
    causal : bool or "bottom_right", optional
        Query ``i`` of sequence ``b`` sees keys ``j <= seqlens[b] - Lq + i``.  Default False,
        as in FlashInfer's paged prefill and FlashAttention's ``flash_attn_with_kvcache``; for
        decoding (``Lq = 1``) the two are the same, for chunked prefill pass ``causal=True``.
        With ``seqlens[b] < Lq`` the first ``Lq - seqlens[b]`` causal rows see no key.
    window : (int, int), optional
        Sliding window ``(left, right)`` around each query's diagonal key (bottom-right, as
        for causal); ``-1`` is unbounded.
    softcap : float, optional
        Apply ``softcap * tanh(s / softcap)`` to the scaled scores (0 or None: no cap).
    return_lse : bool, optional
        Also return the log-sum-exp of each query row's allowed scores.
    lse_base : {"e", 2}, optional
        Base of the returned log-sum-exp: natural (default) or 2 (FlashInfer's convention).
    precision : {"float32", "tf32x3", "tf32"}, optional
        The least precision of the products of float32 inputs the caller accepts, as for
        :func:`softmaxkit.attention`; ignored for other dtypes.
    check_metadata : bool, optional
        Check ``block_table`` and ``seqlens`` before any kernel runs (default).  False skips
        the check and its synchronization (on an accelerator, one boolean read back a call,
        which also rules out CUDA-graph capture): the caller vouches for the metadata, as
        with ``check_finite=False`` in SciPy.  With wrong metadata the result is unspecified
        and a kernel may read outside the page pool or fault.
    backend : str, optional
        Run on this backend only (strict).

    Returns
    -------
    out : array
        ``[B, Hq, Lq, Dv]`` in the promoted dtype of q, k_pages, v_pages; 0 for a query row
        with no allowed key (a sequence of length 0, say).
    lse : array
        Only with ``return_lse``: ``[B, Hq, Lq]`` in float32 (float64 for float64 inputs);
        ``-inf`` for a row with no allowed key.

    Raises
    ------
    TypeError
        ``block_table`` or ``seqlens`` not of dtype int32 or int64.
    ValueError
        Shapes that do not fit together; a negative length, or one beyond the sequence's
        ``max_pages * page_size`` slots; a page a sequence uses outside ``[0, P)``.  The
        metadata is checked before any kernel runs (unless ``check_metadata=False``): on the
        host for host arrays, on the device for arrays on an accelerator (one boolean read
        back: a synchronization).
    NotImplementedError
        A torch tensor requires grad under grad mode: this operation has no gradient.

    Examples
    --------
    >>> import numpy as np, softmaxkit as sk
    >>> rng = np.random.default_rng(0)
    >>> k_pages, v_pages = rng.normal(size=(2, 3, 1, 4, 8))   # 3 pages of 4 keys, 1 head
    >>> q = rng.normal(size=(2, 2, 1, 8))                     # 2 sequences, 2 query heads
    >>> block_table = np.array([[2, 0], [1, -1]], dtype=np.int32)
    >>> seqlens = np.array([6, 3], dtype=np.int32)
    >>> out = sk.paged_attention(q, k_pages, v_pages, block_table, seqlens)
    >>> k0 = np.concatenate([k_pages[2], k_pages[0]], axis=1)[:, :6]   # sequence 0, gathered
    >>> v0 = np.concatenate([v_pages[2], v_pages[0]], axis=1)[:, :6]
    >>> bool(np.allclose(out[0], sk.attention(q[0], k0, v0)))
    True
    """
    framework = route(q, k_pages, v_pages, block_table, seqlens)
    if framework is not None and hasattr(framework, "paged_attention"):  # JAX arrays
        return framework.paged_attention(
            q, k_pages, v_pages, block_table, seqlens, scale=scale, causal=causal,
            window=window, softcap=softcap, return_lse=return_lse, lse_base=lse_base,
            precision=precision, check_metadata=check_metadata, backend=backend)
    refuse_gradient("paged_attention", q, k_pages, v_pages)
    base = args.lse_base(lse_base)
    args.precision(precision, "float32")
    xp = args.namespace(q=q, k_pages=k_pages, v_pages=v_pages, block_table=block_table,
                        seqlens=seqlens)
    q, k_pages, v_pages = args.attention_operands(xp, q, k_pages, v_pages,
                                                  ("q", "k_pages", "v_pages"))
    block_table = index_array(xp, block_table, "block_table", q)
    seqlens = index_array(xp, seqlens, "seqlens", q)
    check_shapes(q, k_pages, v_pages, block_table, seqlens)
    aligned = _causal(causal)
    win = args.window(window)
    cap = args.softcap(softcap)
    scale_f = args.attention_scale(scale, q.shape[-1])
    pages, _, page_size, _ = k_pages.shape
    common = xp.result_type(q.dtype, k_pages.dtype, v_pages.dtype)
    qc, kc, vc = (xp.astype(a, common, copy=False) for a in (q, k_pages, v_pages))
    # last before the backend: on an accelerator the check's read waits for the device, which
    # then idles until the kernel is launched
    if args.flag(check_metadata, "check_metadata") and not _valid_on_device(
            xp, block_table, seqlens, pages, page_size):
        reader = "paged_attention (unless check_metadata=False) validates block_table and seqlens"
        _check_metadata(host_integers(block_table, "block_table", reader),
                        host_integers(seqlens, "seqlens", reader), pages, page_size)
    out, lse = run(
        "paged_attention", xp, qc, backend,
        q=qc, k_pages=kc, v_pages=vc, block_table=block_table, seqlens=seqlens,
        scale=scale_f, causal=aligned, window=win, softcap=cap, return_lse=bool(return_lse),
        precision=args.precision(precision, dtype_name(qc.dtype)),
    )
    if not return_lse:
        return out
    return out, lse_in_base(lse, base)
