"""Packed variable-length attention: against dense attention and the float64 definition on the
unpacked sequences, the metadata errors, and gradients through PyTorch autograd and JAX.

The conformance kit's varlen cases (softmaxkit/testing/varlen_cases.py) run here for the
reference backend; the numba-cpu backend runs them in its own tests.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import softmaxkit as sk
from softmaxkit.testing import Unsupported, cases
from softmaxkit.testing import materialized as ref
from softmaxkit.testing.varlen_cases import packed_arrays, packed_reference

BACKENDS = ("reference", "numba-cpu")
TARGETS = ("numpy", "array_api_strict", "torch-cpu")
KIT = [c for t in TARGETS for c in cases(t, ops=["varlen_attention", "varlen_attention_vjp"])
       if c.dtype in c.target.dtypes]


@pytest.mark.parametrize("case", KIT, ids=lambda c: f"{c.target.name}-{c}")
def test_reference_passes_the_varlen_cases(case):
    try:
        case.run("reference")
    except Unsupported as exc:  # pragma: no cover - the reference serves everything
        pytest.fail(str(exc))


def test_kit_detects_attention_across_sequence_boundaries(monkeypatch):
    """A kernel that lets every query see every packed key (no boundaries) fails the kit."""
    import softmaxkit.reference.varlen as reference
    from softmaxkit.metadata import sequence_spans
    from softmaxkit.testing import check_backend

    def one_sequence(cu_q, cu_k):
        spans = sequence_spans(cu_q, cu_k)
        return [(0, spans[-1][1], 0, spans[-1][3])]

    monkeypatch.setattr(reference, "sequence_spans", one_sequence)
    results = check_backend("reference", ops=["varlen_attention", "varlen_attention_vjp"],
                            dtypes=["float64"])
    assert results and all(r.status == "failed" for r in results)


def _packed(seed, lens_q, lens_k, hq=4, hk=2, d=8, dv=6, dtype=np.float64):
    return packed_arrays(seed, lens_q, lens_k, hq, hk, d, dv, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True, "top_left"])
def test_matches_dense_attention_on_each_sequence(backend, causal):
    q, k, v, cu_q, cu_k = _packed(0, (5, 1, 0, 7, 3), (5, 4, 3, 2, 0))
    out, lse = sk.varlen_attention(q, k, v, cu_q, cu_k, causal=causal, window=(3, -1),
                                   return_lse=True, backend=backend)
    assert out.shape == (16, 4, 6) and lse.shape == (16, 4) and lse.dtype == np.float64
    for b in range(5):
        q0, q1, k0, k1 = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        d_out, d_lse = sk.attention(q[q0:q1].transpose(1, 0, 2), k[k0:k1].transpose(1, 0, 2),
                                    v[k0:k1].transpose(1, 0, 2), causal=causal,
                                    window=(3, -1), return_lse=True, backend=backend)
        e_out, e_lse = ref.attention(q[q0:q1].transpose(1, 0, 2), k[k0:k1].transpose(1, 0, 2),
                                     v[k0:k1].transpose(1, 0, 2), window=(3, -1),
                                     causal={False: None, True: "bottom_right"}.get(causal,
                                                                                    causal))
        np.testing.assert_allclose(out[q0:q1], d_out.transpose(1, 0, 2), rtol=0, atol=1e-14)
        np.testing.assert_array_equal(lse[q0:q1] == -np.inf, d_lse.T == -np.inf)
        np.testing.assert_allclose(out[q0:q1], e_out.transpose(1, 0, 2), rtol=0, atol=1e-12)
        np.testing.assert_allclose(lse[q0:q1], e_lse.T, rtol=0, atol=1e-12)
    # the sequence with no keys: out 0, lse -inf; bottom-right causal leaves rows of the
    # sequence with more queries than keys empty too
    assert np.all(out[13:16] == 0) and np.all(lse[13:16] == -np.inf)
    if causal is True:
        assert np.all(lse[6:11] == -np.inf) and np.all(out[6:11] == 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_padded_batch_with_a_key_padding_mask_agrees(backend):
    """An independent dense formulation: the sequences padded to a batch, padding masked."""
    lens_q, lens_k = (4, 2, 6), (3, 7, 5)
    q, k, v, cu_q, cu_k = _packed(1, lens_q, lens_k, hq=2, hk=2)
    lq, lk = max(lens_q), max(lens_k)
    qp, kp, vp = np.zeros((3, 2, lq, 8)), np.zeros((3, 2, lk, 8)), np.zeros((3, 2, lk, 6))
    mask = np.zeros((3, 1, 1, lk), dtype=bool)
    for b in range(3):
        qp[b, :, :lens_q[b]] = q[cu_q[b]:cu_q[b + 1]].transpose(1, 0, 2)
        kp[b, :, :lens_k[b]] = k[cu_k[b]:cu_k[b + 1]].transpose(1, 0, 2)
        vp[b, :, :lens_k[b]] = v[cu_k[b]:cu_k[b + 1]].transpose(1, 0, 2)
        mask[b, ..., :lens_k[b]] = True
    dense = sk.attention(qp, kp, vp, mask=mask, backend=backend)
    out = sk.varlen_attention(q, k, v, cu_q, cu_k, backend=backend)
    for b in range(3):
        np.testing.assert_allclose(out[cu_q[b]:cu_q[b + 1]],
                                   dense[b, :, :lens_q[b]].transpose(1, 0, 2), atol=1e-14)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradient_matches_the_float64_definition(backend):
    q, k, v, cu_q, cu_k = _packed(2, (3, 0, 6, 2), (4, 3, 3, 0))
    out, lse = sk.varlen_attention(q, k, v, cu_q, cu_k, causal=True, return_lse=True,
                                   backend=backend)
    dout = np.random.default_rng(3).normal(size=out.shape)
    dq, dk, dv = sk.varlen_attention_vjp(q, k, v, out, lse, dout, cu_q, cu_k, causal=True,
                                         backend=backend)
    expected = [np.zeros_like(a) for a in (q, k, v)]
    for b in range(4):
        q0, q1, k0, k1 = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        grads = ref.attention_vjp(q[q0:q1].transpose(1, 0, 2), k[k0:k1].transpose(1, 0, 2),
                                  v[k0:k1].transpose(1, 0, 2), dout[q0:q1].transpose(1, 0, 2),
                                  causal="bottom_right")
        for e, g, (lo, hi) in zip(expected, grads, ((q0, q1), (k0, k1), (k0, k1)),
                                  strict=True):
            e[lo:hi] = g.transpose(1, 0, 2)
    for got, e in zip((dq, dk, dv), expected, strict=True):
        assert got.shape == e.shape and got.dtype == np.float64
        assert ref.rel_frobenius(got, e) <= 1e-10
    assert np.all(dk[4:7] == 0) and np.all(dv[4:7] == 0)  # keys of the query-less sequence
    assert np.all(dq[13:15] == 0)  # queries of the key-less sequence
    # base-2 lse in gives the same gradient
    again = sk.varlen_attention_vjp(q, k, v, out, lse / math.log(2.0), dout, cu_q, cu_k,
                                    causal=True, lse_base=2, backend=backend)
    for a, b in zip(again, (dq, dk, dv), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype, acc", [(np.float32, np.float32), (np.float16, np.float32)])
def test_dtypes(backend, dtype, acc):
    q, k, v, cu_q, cu_k = _packed(4, (3, 5), (4, 4), dtype=dtype)
    out, lse = sk.varlen_attention(q, k, v, cu_q.astype(np.int32), cu_k.astype(np.int32),
                                   return_lse=True, backend=backend)
    assert out.dtype == dtype and lse.dtype == acc
    e_out, e_lse = packed_reference(q.astype(np.float64), k.astype(np.float64),
                                    v.astype(np.float64), cu_q, cu_k)
    tol = {np.float32: 1e-5, np.float16: 4e-3}[dtype]
    assert ref.rel_frobenius(out.astype(np.float64), e_out) <= tol
    grads = sk.varlen_attention_vjp(q, k, v, out, lse, out, cu_q, cu_k, backend=backend)
    assert [g.dtype for g in grads] == [dtype] * 3


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batches_and_sequences(backend):
    q, k, v = np.zeros((0, 2, 4)), np.zeros((0, 1, 4)), np.zeros((0, 1, 3))
    out, lse = sk.varlen_attention(q, k, v, [0], [0], return_lse=True, backend=backend)
    assert out.shape == (0, 2, 3) and lse.shape == (0, 2)
    # every sequence without keys: out 0, lse -inf, zero gradient
    q = np.ones((3, 2, 4))
    out, lse = sk.varlen_attention(q, k, v, [0, 1, 3], [0, 0, 0], return_lse=True,
                                   backend=backend)
    assert np.all(out == 0) and np.all(lse == -np.inf)
    dq, dk, dv = sk.varlen_attention_vjp(q, k, v, out, lse, np.ones_like(out), [0, 1, 3],
                                         [0, 0, 0], backend=backend)
    assert np.all(dq == 0) and dk.shape == (0, 1, 4) and dv.shape == (0, 1, 3)


def test_default_dispatch_and_inputs_left_unchanged():
    q, k, v, cu_q, cu_k = _packed(5, (2, 3), (3, 3))
    before = [a.copy() for a in (q, k, v, cu_q, cu_k)]
    with sk.backend_opts(trace=True) as trace:
        sk.varlen_attention(q, k, v, cu_q, cu_k, causal=True)
    assert trace[-1].op == "varlen_attention" and trace[-1].backend == "numba-cpu"
    for a, b in zip((q, k, v, cu_q, cu_k), before, strict=True):
        np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------------------------------------
# metadata errors: named, raised before any kernel runs

Q, K, V = np.zeros((5, 2, 4)), np.zeros((6, 1, 4)), np.zeros((6, 1, 3))


@pytest.mark.parametrize("cu_q, cu_k, error, match", [
    ([1, 5], [0, 6], ValueError, "cu_seqlens_q must start at 0; got 1"),
    ([0, 5], [-1, 6], ValueError, "cu_seqlens_k must start at 0"),
    ([0, 3, 2, 5], [0, 2, 4, 6], ValueError, "cu_seqlens_q decreases from 3 to 2 at entry 2"),
    ([0, 6], [0, 6], ValueError, "cu_seqlens_q ends at 6, past the packed length Tq"),
    ([0, 5], [0, 7], ValueError, "cu_seqlens_k ends at 7, past the packed length Tk"),
    ([0, 4], [0, 6], ValueError, "cu_seqlens_q ends at 4, before the packed length Tq"),
    ([0, 2, 5], [0, 6], ValueError, "cu_seqlens_q has 3 entries and cu_seqlens_k 2"),
    ([[0, 5]], [0, 6], ValueError, r"cu_seqlens_q of shape \(1, 2\) must be one-dimensional"),
    ([], [0, 6], (ValueError, TypeError), "cu_seqlens_q"),
    (np.array([0.0, 5.0]), [0, 6], TypeError, "cu_seqlens_q has dtype float64"),
    (np.array([0, 5], dtype=np.int16), [0, 6], TypeError, "cu_seqlens_q has dtype int16"),
    ([0, 5], np.array([0, 6], dtype=np.uint32), TypeError, "cu_seqlens_k has dtype uint32"),
    ([0, 5], np.array([False, True]), TypeError, "cu_seqlens_k has dtype bool"),
])
@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_metadata_is_a_named_error_before_any_kernel(cu_q, cu_k, error, match, backend):
    lse, out = np.zeros((5, 2)), np.zeros((5, 2, 3))
    with sk.backend_opts(trace=True) as trace:
        with pytest.raises(error, match=match):
            sk.varlen_attention(Q, K, V, cu_q, cu_k, backend=backend)
        with pytest.raises(error, match=match):
            sk.varlen_attention_vjp(Q, K, V, out, lse, out, cu_q, cu_k, backend=backend)
    assert trace == []


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match=r"q must have the packed shape \[Tq, Hq, D\]"):
        sk.varlen_attention(np.zeros((1, 5, 2, 4)), K, V, [0, 5], [0, 6])
    with pytest.raises(ValueError, match="multiple of k's and v's 3 heads"):
        sk.varlen_attention(Q, np.zeros((6, 3, 4)), np.zeros((6, 3, 3)), [0, 5], [0, 6])
    with pytest.raises(ValueError, match="v of shape"):
        sk.varlen_attention(Q, K, np.zeros((5, 1, 3)), [0, 5], [0, 6])
    with pytest.raises(ValueError, match=r"lse of shape \(5,\) must have shape \(5, 2\)"):
        sk.varlen_attention_vjp(Q, K, V, np.zeros((5, 2, 3)), np.zeros(5), np.zeros((5, 2, 3)),
                                [0, 5], [0, 6])


# ---------------------------------------------------------------------------------------------
# frameworks

torch = pytest.importorskip("torch")


def _dense_torch(q, k, v, cu_q, cu_k, causal):
    """float64 dense attention per sequence in plain torch ops, differentiated by autograd."""
    outs, lses = [], []
    group = q.shape[1] // k.shape[1]
    for b in range(len(cu_q) - 1):
        q0, q1, k0, k1 = (int(x) for x in (cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]))
        qq = q[q0:q1].transpose(0, 1)
        kk = k[k0:k1].transpose(0, 1).repeat_interleave(group, 0)
        vv = v[k0:k1].transpose(0, 1).repeat_interleave(group, 0)
        s = qq @ kk.transpose(-1, -2) / math.sqrt(q.shape[-1])
        if causal:
            i = torch.arange(q1 - q0)[:, None]
            j = torch.arange(k1 - k0)[None, :]
            s = s.masked_fill(j > i + (k1 - k0) - (q1 - q0), -math.inf)
        lse = torch.logsumexp(s, -1)
        p = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
        outs.append((p @ vv).transpose(0, 1))
        lses.append(lse.transpose(0, 1))
    return torch.cat(outs), torch.cat(lses)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True])
def test_torch_autograd_matches_a_float64_dense_reference(backend, causal):
    g = torch.Generator().manual_seed(6)
    cu_q = torch.tensor([0, 3, 3, 9, 11], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 7, 7, 10])
    leaves = [torch.randn(s, generator=g, dtype=torch.float64, requires_grad=True)
              for s in ((11, 4, 8), (10, 2, 8), (10, 2, 6))]
    w_out = torch.randn(11, 4, 6, generator=g, dtype=torch.float64)
    w_lse = torch.randn(11, 4, generator=g, dtype=torch.float64)

    def loss(out, lse):  # uses the lse too, so its gradient path is checked
        return (out * w_out).sum() + (torch.where(torch.isfinite(lse), lse, 0.0) * w_lse).sum()

    out, lse = sk.varlen_attention(*leaves, cu_q, cu_k, causal=causal, return_lse=True,
                                   backend=backend)
    assert out.requires_grad and lse.requires_grad
    got = torch.autograd.grad(loss(out, lse), leaves)
    e_out, e_lse = _dense_torch(*leaves, cu_q, cu_k, causal)
    expected = torch.autograd.grad(loss(e_out, e_lse), leaves)
    torch.testing.assert_close(out, e_out, rtol=0, atol=1e-12)
    for a, e in zip(got, expected, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-12)
    assert torch.all(got[1][5:7] == 0)  # keys of the sequence with no queries


def test_torch_gradcheck_and_plain_calls():
    g = torch.Generator().manual_seed(7)
    cu_q, cu_k = torch.tensor([0, 2, 5]), torch.tensor([0, 3, 4])
    leaves = [torch.randn(s, generator=g, dtype=torch.float64, requires_grad=True)
              for s in ((5, 2, 3), (4, 1, 3), (4, 1, 2))]
    # top-left alignment: every row sees a key, so no lse is -inf (finite differences of -inf
    # are NaN); empty rows are covered against the dense reference above
    torch.autograd.gradcheck(
        lambda q, k, v: sk.varlen_attention(q, k, v, cu_q, cu_k, causal="top_left",
                                            window=(2, -1), return_lse=True), leaves)
    with torch.no_grad():
        out = sk.varlen_attention(*leaves, cu_q, cu_k)
    assert out.grad_fn is None and isinstance(out, torch.Tensor)
    # bad metadata names the argument on the autograd path as well
    with pytest.raises(ValueError, match="cu_seqlens_k ends at 5, past the packed length"):
        sk.varlen_attention(*leaves, cu_q, torch.tensor([0, 3, 5]))


def test_torch_operators_pass_opcheck():
    from softmaxkit.frameworks import torch as ops

    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(s, generator=g, dtype=torch.float64, requires_grad=True)
               for s in ((5, 2, 3), (4, 1, 3), (4, 1, 2)))
    cu_q, cu_k = torch.tensor([0, 2, 5]), torch.tensor([0, 3, 4])
    torch.library.opcheck(ops.varlen_attention_op,
                          (q, k, v, cu_q, cu_k, None, "bottom_right", [-1, -1], None,
                           "float32", None, True))
    out, lse = sk.varlen_attention(q.detach(), k.detach(), v.detach(), cu_q, cu_k,
                                   return_lse=True)
    for dlse in (None, torch.randn(lse.shape, generator=g, dtype=torch.float64)):
        torch.library.opcheck(ops.varlen_attention_vjp_op,
                              (q.detach(), k.detach(), v.detach(), out, lse, out, dlse, cu_q,
                               cu_k, None, None, [-1, -1], 2.0, "float32", None))


def test_torch_compile_traces_varlen_without_graph_breaks():
    g = torch.Generator().manual_seed(10)
    cu_q, cu_k = torch.tensor([0, 2, 5]), torch.tensor([0, 3, 4])
    q, k, v = (torch.randn(s, generator=g, dtype=torch.float64, requires_grad=True)
               for s in ((5, 2, 3), (4, 1, 3), (4, 1, 2)))

    def step(q, k, v):
        return sk.varlen_attention(q, k, v, cu_q, cu_k, causal=True).square().sum()

    explained = torch._dynamo.explain(step)(q, k, v)
    assert explained.graph_break_count == 0
    eager = torch.autograd.grad(step(q, k, v), (q, k, v))
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    for a, b in zip(torch.autograd.grad(compiled(q, k, v), (q, k, v)), eager, strict=True):
        torch.testing.assert_close(a, b)


def test_jax_grad_and_jit_match_torch():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    jax.config.update("jax_enable_x64", True)
    q, k, v, cu_q, cu_k = _packed(9, (3, 0, 4), (2, 3, 5))

    def jax_loss(q, k, v):
        out, lse = sk.varlen_attention(q, k, v, cu_q, cu_k, causal=True, return_lse=True)
        return jnp.sum(out * out) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

    grad = jax.grad(jax_loss, argnums=(0, 1, 2))
    eager = grad(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
    jitted = jax.jit(grad)(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
    leaves = [torch.tensor(a, requires_grad=True) for a in (q, k, v)]
    e_out, e_lse = _dense_torch(*leaves, cu_q, cu_k, True)
    ((e_out * e_out).sum() + torch.where(torch.isfinite(e_lse), e_lse, 0.0).sum()).backward()
    for a, b, leaf in zip(eager, jitted, leaves, strict=True):
        np.testing.assert_allclose(np.asarray(a), leaf.grad.numpy(), rtol=1e-10, atol=1e-12)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_jax_metadata_errors_are_named():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    q, k, v = jnp.zeros((5, 2, 4)), jnp.zeros((6, 1, 4)), jnp.zeros((6, 1, 3))
    with pytest.raises(ValueError, match="cu_seqlens_q ends at 6, past the packed length"):
        sk.varlen_attention(q, k, v, [0, 6], [0, 6])
    with pytest.raises(TypeError, match="cu_seqlens_k has dtype int16"):
        sk.varlen_attention(q, k, v, [0, 5], np.array([0, 6], dtype=np.int16))
    # traced lengths are validated in the host callback; the message comes through
    jitted = jax.jit(lambda q, k, v, cq, ck: sk.varlen_attention(q, k, v, cq, ck))
    assert jitted(q, k, v, jnp.array([0, 2, 5]), jnp.array([0, 3, 6])).shape == (5, 2, 3)
    with pytest.raises(Exception, match="cu_seqlens_q ends at 6, past the packed length"):
        jitted(q, k, v, jnp.array([0, 2, 6]), jnp.array([0, 3, 6])).block_until_ready()



def test_backends_get_the_lengths_the_frontend_read(monkeypatch):
    """Within a call a backend's host read of the cumulative lengths returns the values the
    frontend validated (no second device-to-host copy, which on a GPU is a synchronization);
    outside the call, or for another array, the array is read."""
    from softmaxkit import metadata

    cu = np.array([0, 3, 7])
    seen = np.array([0, 3, 7], dtype=np.int64)
    with metadata.validated((cu, seen)):
        assert metadata.host_integers(cu, "cu_seqlens_q", "test") is seen
        assert metadata.host_integers(np.array([0, 3, 7]), "cu_seqlens_q", "test") is not seen
    assert metadata.host_integers(cu, "cu_seqlens_q", "test") is not seen

    torch = pytest.importorskip("torch")
    q, k, v, cu_q, cu_k = packed_arrays(3, (3, 0, 4), (2, 5, 1), 2, 1, 8, 8)
    tq, tk, tv = (torch.as_tensor(a) for a in (q, k, v))
    tcu_q, tcu_k = (torch.as_tensor(a, dtype=torch.int32) for a in (cu_q, cu_k))
    reads = []
    real = torch.Tensor.cpu

    def counting(self, *args, **kwargs):
        reads.append(tuple(self.shape))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "cpu", counting)
    out = sk.varlen_attention(tq, tk, tv, tcu_q, tcu_k, causal=True, backend="numba-cpu")
    # the frontend's two reads; the backend walks the sequences from the same values
    assert reads == [(4,), (4,)]
    want, _ = packed_reference(q, k, v, cu_q, cu_k, scale=8 ** -0.5, causal="bottom_right")
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-10, atol=1e-12)
