"""numba-cpu packed variable-length attention: its dense kernels, once per group of lengths.

With shrunk tiles, sequences of a few hundred keys cross many tile boundaries; each packed
result must equal, bit for bit, the backend's dense attention on the unpacked sequence (the
same kernels; these sizes run on one thread, so even the gradient sums in one order), and lie
within the spec's bounds of the float64 definition.
"""

from __future__ import annotations

import numpy as np
import pytest

import softmaxkit as sk
from softmaxkit.testing import materialized as ref
from softmaxkit.testing.varlen_cases import packed_arrays, packed_reference

NAME = "numba-cpu"


def _packed(seed, lens_q, lens_k, hq=4, hk=2, d=16, dv=8, dtype=np.float32):
    return packed_arrays(seed, lens_q, lens_k, hq, hk, d, dv, dtype, np.int32)


def _heads_first(a):
    return a.transpose(1, 0, 2)


LENGTHS = {
    "distinct": ((70, 0, 130, 5), (90, 17, 100, 0)),
    # sequences of equal lengths run as one batch
    "grouped": ((40, 40, 7, 0, 40, 7), (50, 50, 0, 9, 50, 0)),
}


@pytest.mark.parametrize("lengths", list(LENGTHS))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("causal, window", [(True, None), ("top_left", (40, 3)), (False, None)])
def test_long_sequences_equal_dense_attention(small_tiles, lengths, dtype, causal, window):
    q, k, v, cu_q, cu_k = _packed(0, *LENGTHS[lengths], dtype=dtype)
    out, lse = sk.varlen_attention(q, k, v, cu_q, cu_k, causal=causal, window=window,
                                   return_lse=True, backend=NAME)
    dout = np.random.default_rng(1).normal(size=out.shape).astype(dtype)
    grads = sk.varlen_attention_vjp(q, k, v, out, lse, dout, cu_q, cu_k, causal=causal,
                                    window=window, backend=NAME)
    for b in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        if q1 == q0:
            assert np.all(grads[1][k0:k1] == 0) and np.all(grads[2][k0:k1] == 0)
            continue
        dense = [_heads_first(a) for a in (q[q0:q1], k[k0:k1], v[k0:k1])]
        d_out, d_lse = sk.attention(*dense, causal=causal, window=window, return_lse=True,
                                    backend=NAME)
        np.testing.assert_array_equal(out[q0:q1], _heads_first(d_out))
        np.testing.assert_array_equal(lse[q0:q1], d_lse.T)
        d_grads = sk.attention_vjp(*dense, d_out, d_lse, _heads_first(dout[q0:q1]),
                                   causal=causal, window=window, backend=NAME)
        for g, dg, (lo, hi) in zip(grads, d_grads, ((q0, q1), (k0, k1), (k0, k1)),
                                   strict=True):
            np.testing.assert_array_equal(g[lo:hi], _heads_first(dg))
    e_out, _ = packed_reference(q.astype(np.float64), k.astype(np.float64),
                                v.astype(np.float64), cu_q, cu_k,
                                causal={True: "bottom_right", False: None}.get(causal, causal),
                                window=window)
    assert ref.rel_frobenius(out.astype(np.float64), e_out) <= (
        1e-5 if dtype == np.float32 else 1e-12)


def test_strided_inputs_and_torch_bfloat16():
    torch = pytest.importorskip("torch")
    q, k, v, cu_q, cu_k = _packed(2, (6, 9), (11, 4))
    # packed arrays that are views with other strides (heads-major storage)
    qs, ks, vs = (np.ascontiguousarray(a.transpose(1, 0, 2)).transpose(1, 0, 2)
                  for a in (q, k, v))
    assert not qs.flags.c_contiguous
    np.testing.assert_array_equal(sk.varlen_attention(qs, ks, vs, cu_q, cu_k, backend=NAME),
                                  sk.varlen_attention(q, k, v, cu_q, cu_k, backend=NAME))
    t = [torch.from_numpy(a).to(torch.bfloat16) for a in (q, k, v)]
    cq, ck = torch.from_numpy(cu_q), torch.from_numpy(cu_k)
    with sk.backend_opts(trace=True) as trace:
        out, lse = sk.varlen_attention(*t, cq, ck, causal=True, return_lse=True)
    assert trace[-1].backend == NAME
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    rep = [a.to(torch.float64).numpy() for a in t]
    e_out, e_lse = packed_reference(*rep, cu_q, cu_k, causal="bottom_right")
    assert ref.rel_frobenius(out.to(torch.float64).numpy(), e_out) <= 3e-2
    fin = np.isfinite(e_lse)
    assert np.array_equal(np.isfinite(lse.numpy()), fin)
    assert np.max(np.abs(lse.numpy()[fin] - e_lse[fin])) <= 2e-3
