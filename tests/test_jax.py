"""JAX transformations through softmaxkit's custom_vjp wrappers.

References: central finite differences in float64 for jax.grad, the library's own VJP
functions on numpy for jax.vjp, eager results for jax.jit and per-example loops for jax.vmap.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy
jax.config.update("jax_enable_x64", True)

import softmaxkit as sk  # noqa: E402


def _rand(*shape, seed=0):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape))


def _finite_difference(f, x, eps=1e-6):
    """Central differences of a scalar function of one float64 array (one vmapped call)."""
    x = np.asarray(x, dtype=np.float64)
    steps = np.eye(x.size).reshape((x.size,) + x.shape) * eps
    values = np.asarray(jax.vmap(f)(jnp.asarray(np.concatenate([x + steps, x - steps]))))
    return ((values[: x.size] - values[x.size:]) / (2 * eps)).reshape(x.shape)


def _check_grad(f, x, *, jit=True):
    g = jax.grad(f)(x)
    np.testing.assert_allclose(g, _finite_difference(f, x), rtol=1e-6, atol=1e-8)
    if jit:
        np.testing.assert_allclose(jax.jit(jax.grad(f))(x), g, rtol=1e-12, atol=1e-14)


def _weights(shape, seed=7):
    return _rand(*shape, seed=seed)


def test_grad_softmax_family_with_a_fully_masked_row():
    x = _rand(3, 5)
    where = np.ones((3, 5), dtype=bool)
    where[0, 1] = where[2, 3] = False
    where[1] = False
    w = _weights((3, 5))
    _check_grad(lambda x: jnp.sum(w * sk.softmax(x, -1, where=where)), x)
    _check_grad(lambda x: jnp.sum(jnp.where(where, w * sk.log_softmax(x, 0, where=where), 0)), x)
    g = jax.grad(lambda x: jnp.sum(jnp.where(where, sk.log_softmax(x, -1, where=where), 0)))(x)
    assert np.all(np.asarray(g)[1] == 0) and np.all(np.isfinite(g))


def test_grad_logsumexp():
    x = _rand(3, 4, 2)
    _check_grad(lambda x: jnp.sum(_weights((3, 2)) * sk.logsumexp(x, axis=1)), x)
    _check_grad(lambda x: sk.logsumexp(x), x)
    b = jnp.abs(_rand(3, 4, 2, seed=3)) + 0.1
    _check_grad(lambda x: jnp.sum(sk.logsumexp(x, axis=(0, 2), b=b, keepdims=True)), x)
    _check_grad(lambda b: jnp.sum(sk.logsumexp(x, axis=-1, b=b)), b)
    where = np.ones((3, 4, 2), dtype=bool)
    where[0] = False  # empty rows: lse = -inf, gradient 0
    g = jax.grad(lambda x: jnp.sum(sk.logsumexp(x, axis=(1, 2), where=where)[1:]))(x)
    assert np.all(np.asarray(g)[0] == 0) and np.all(np.isfinite(g))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_grad_cross_entropy(reduction):
    x = _rand(5, 4)
    target = jnp.asarray([0, 3, -100, 1, 3])
    kw = dict(reduction=reduction, ignore_index=-100, label_smoothing=0.1)
    _check_grad(lambda x: jnp.sum(_weights((5,))[: 5] * sk.cross_entropy(x, target, **kw))
                if reduction == "none" else sk.cross_entropy(x, target, **kw), x)


def test_grad_cross_entropy_probability_targets_and_return_grad():
    x = _rand(2, 3, 4)
    probs = jax.nn.softmax(_rand(2, 3, 4, seed=5), axis=1)
    _check_grad(lambda x: sk.cross_entropy(x, probs, axis=1), x)
    _check_grad(lambda p: sk.cross_entropy(x, p, axis=1, label_smoothing=0.2), probs)
    loss, dlogits = sk.cross_entropy(x, probs, axis=1, return_grad=True)
    np.testing.assert_allclose(dlogits, jax.grad(lambda x: sk.cross_entropy(x, probs, axis=1))(x),
                               rtol=1e-13)


ATTENTION = {
    "causal-bottom-right": dict(causal=True),
    "causal-top-left": dict(causal="top_left"),
    "window-softcap": dict(window=(1, 1), softcap=2.0),
    "mask": dict(mask=np.array([[True, False, True, True, False],
                                [False] * 5,
                                [True, True, False, False, True]])),
}


@pytest.mark.parametrize("case", list(ATTENTION))
def test_grad_attention(case):
    q, k, v = _rand(4, 3, 2, seed=1), _rand(2, 5, 2, seed=2), _rand(2, 5, 3, seed=3)
    kw = ATTENTION[case]
    w, wl = _weights((4, 3, 3)), _weights((4, 3), seed=8)

    def loss(q, k, v):
        out, lse = sk.attention(q, k, v, return_lse=True, **kw)
        return jnp.sum(w * out) + jnp.sum(jnp.where(jnp.isfinite(lse), wl * lse, 0))

    for i, a in enumerate((q, k, v)):
        args = [q, k, v]

        def f(a, i=i, args=args):
            args = list(args)
            args[i] = a
            return loss(*args)

        _check_grad(f, a, jit=i == 0)
    if case == "mask":  # the query row with no allowed key has zero gradient
        assert np.all(np.asarray(jax.grad(loss)(q, k, v))[:, 1] == 0)


def test_grad_merge_attention_states():
    outs, lses = _rand(3, 2, 4), _rand(3, 2, seed=1)
    lses = lses.at[1, 0].set(-jnp.inf)  # an empty partial
    w, wl = _weights((2, 4)), _weights((2,), seed=9)

    def loss(outs, lses):
        out, lse = sk.merge_attention_states(outs, lses, lse_base=2)
        return jnp.sum(w * out) + jnp.sum(wl * lse)

    _check_grad(lambda o: loss(o, lses), outs)
    g = jax.grad(loss, 1)(outs, lses)
    np.testing.assert_allclose(
        jnp.where(jnp.isfinite(lses), g, 0),
        _finite_difference(lambda s: loss(outs, jnp.where(jnp.isfinite(lses), s, -jnp.inf)),
                           jnp.where(jnp.isfinite(lses), lses, 0)),
        rtol=1e-6, atol=1e-8,
    )


def test_vjp_is_the_librarys_vjp():
    x, g = _rand(3, 6), _rand(3, 6, seed=1)
    for op, vjp in ((sk.softmax, sk.softmax_vjp), (sk.log_softmax, sk.log_softmax_vjp)):
        y, pullback = jax.vjp(lambda x, op=op: op(x, -1), x)
        (got,) = pullback(g)
        np.testing.assert_array_equal(got, vjp(np.asarray(y), np.asarray(g), -1))
    q, k, v = _rand(2, 3, 4, seed=2), _rand(1, 5, 4, seed=3), _rand(1, 5, 2, seed=4)
    (out, lse), pullback = jax.vjp(lambda q, k, v: sk.attention(q, k, v, causal=True,
                                                                return_lse=True), q, k, v)
    dout = _rand(2, 3, 2, seed=5)
    got = pullback((dout, jnp.zeros_like(lse)))
    want = sk.attention_vjp(*(np.asarray(a) for a in (q, k, v, out, lse, dout)), causal=True)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-13, atol=1e-15)


def test_vmap_matches_a_loop_and_batches_gradients():
    x = _rand(4, 3, 5)
    target = jnp.asarray([[0, 1, 4], [2, 2, 2], [1, -1, 0], [3, 4, 0]])
    for fn in (lambda x: sk.softmax(x),  # axis=None: each example's own axes only
               lambda x: sk.logsumexp(x, 0),
               lambda x, t=target: x):
        np.testing.assert_allclose(jax.vmap(fn)(x), jnp.stack([fn(r) for r in x]), rtol=1e-13)

    def loss(x, t):
        return sk.cross_entropy(x, t, ignore_index=-1)

    batched = jax.vmap(loss)(x, target)
    np.testing.assert_allclose(batched, [loss(a, t) for a, t in zip(x, target, strict=True)],
                               rtol=1e-13)
    grads = jax.vmap(jax.grad(loss))(x, target)
    for g, a, t in zip(grads, x, target, strict=True):
        np.testing.assert_allclose(g, jax.grad(loss)(a, t), rtol=1e-13)
    q = _rand(3, 2, 4, 2)
    k, v = _rand(1, 5, 2, seed=1), _rand(1, 5, 3, seed=2)
    out = jax.jit(jax.vmap(lambda q: sk.attention(q, k, v, causal=True)))(q)
    np.testing.assert_allclose(out, sk.attention(q, k, v, causal=True), rtol=1e-13)


def test_numba_kernels_run_under_jit():
    x = _rand(4, 7).astype(jnp.float32)
    f = jax.jit(lambda x: sk.softmax(x, -1, backend="numba-cpu"))
    np.testing.assert_allclose(f(x), jax.nn.softmax(x, -1), rtol=2e-6, atol=1e-7)
    g = jax.jit(jax.grad(lambda x: sk.cross_entropy(x, jnp.arange(4), backend="numba-cpu")))(x)
    want = jax.grad(lambda x: -jnp.mean(jax.nn.log_softmax(x)[jnp.arange(4), jnp.arange(4)]))(x)
    np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-7)
    assert math.isfinite(float(jnp.sum(g)))


@pytest.mark.parametrize("used", ["out", "lse", "both"])
@pytest.mark.parametrize("jit", [False, True])
def test_a_returned_lse_reaches_the_backward_only_when_the_loss_uses_it(monkeypatch, used,
                                                                         jit):
    """An lse that is returned but unused reaches the backward as a symbolic zero and the VJP
    gets no ``dlse``; a used one's cotangent reaches it as ``dlse``; gradients equal the
    float64 definition's."""
    import importlib

    module = importlib.import_module("softmaxkit.frameworks.jax")
    seen = []
    vjp = module._attention_vjp_fn

    def recorded(*a, dlse=None, **kw):
        seen.append("" if dlse is None else "dlse")
        return vjp(*a, dlse=dlse, **kw)

    monkeypatch.setattr(module, "_attention_vjp_fn", recorded)
    module._attention_custom.cache_clear()  # rules built before the patch hold the real one
    q, k, v = _rand(2, 5, 4, seed=6), _rand(1, 7, 4, seed=7), _rand(1, 7, 3, seed=8)

    def loss(q, k, v):
        out, lse = sk.attention(q, k, v, causal=True, return_lse=True)
        return {"out": jnp.sum(out ** 2), "lse": jnp.sum(lse),
                "both": jnp.sum(out ** 2) + jnp.sum(lse)}[used]

    def definition(q, k, v):
        s = q @ jnp.swapaxes(k, -1, -2) / math.sqrt(4)
        s = jnp.where(jnp.tril(jnp.ones((5, 7), bool), 2), s, -jnp.inf)
        out, lse = jax.nn.softmax(s, -1) @ v, jax.nn.logsumexp(s, -1)
        return {"out": jnp.sum(out ** 2), "lse": jnp.sum(lse),
                "both": jnp.sum(out ** 2) + jnp.sum(lse)}[used]

    grad = jax.grad(loss, (0, 1, 2))
    got = (jax.jit(grad) if jit else grad)(q, k, v)
    assert seen == ["" if used == "out" else "dlse"]
    for a, b in zip(got, jax.grad(definition, (0, 1, 2))(q, k, v), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-13)
    module._attention_custom.cache_clear()


@pytest.mark.parametrize("jit", [False, True])
def test_varlen_lse_in_the_loss_trains_like_the_definition(jit):
    """A loss of varlen attention's out and its base-2 lse: the lse's cotangent reaches the
    VJP (as dlse) and the gradients equal the float64 definition's, sequence by sequence."""
    q, k, v = _rand(5, 2, 3, seed=11), _rand(7, 1, 3, seed=12), _rand(7, 1, 2, seed=13)
    cu_q, cu_k = jnp.asarray([0, 2, 5]), jnp.asarray([0, 3, 7])

    def loss(q, k, v):
        out, lse = sk.varlen_attention(q, k, v, cu_q, cu_k, causal=True, return_lse=True,
                                       lse_base=2)
        return jnp.sum(out ** 2) + jnp.sum(jnp.sin(lse))

    def definition(q, k, v):
        total = 0.0
        for (a, b), (c, d) in (((0, 2), (0, 3)), ((2, 5), (3, 7))):
            s = jnp.einsum("qhd,khd->hqk", q[a:b], jnp.repeat(k[c:d], 2, axis=1)) / math.sqrt(3)
            lq, lk = b - a, d - c
            allowed = jnp.arange(lk)[None, :] <= jnp.arange(lq)[:, None] + (lk - lq)
            s = jnp.where(allowed, s, -jnp.inf)
            out = jnp.einsum("hqk,khd->qhd", jax.nn.softmax(s, -1), jnp.repeat(v[c:d], 2, axis=1))
            total = total + jnp.sum(out ** 2) + jnp.sum(jnp.sin(jax.nn.logsumexp(s, -1)
                                                                / math.log(2.0)))
        return total

    grad = jax.grad(loss, (0, 1, 2))
    got = (jax.jit(grad) if jit else grad)(q, k, v)
    for a, b in zip(got, jax.grad(definition, (0, 1, 2))(q, k, v), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-13)


def test_traced_arrays_mix_with_concrete_ones():
    """A mask or a cache held concrete outside ``jit`` or ``grad`` meets a traced array, which
    has no device until the computation runs: it is not a device mismatch.  The results are
    the eager ones, and the gradient of a mass over a masked summary is the finite
    differences'."""
    x = _rand(3, 5)
    where = jnp.asarray(np.random.default_rng(1).random((3, 5)) > 0.3)

    def mass(a):
        return jnp.sum(sk.summarize(a, axis=-1, where=where).mass)

    np.testing.assert_allclose(jax.jit(mass)(x), mass(x), rtol=1e-12)
    _check_grad(mass, x, jit=False)
    q = _rand(1, 2, 3, 8, seed=2)
    k_pages, v_pages = _rand(3, 2, 4, 8, seed=3), _rand(3, 2, 4, 8, seed=4)
    table, lens = jnp.asarray([[2, 0, 1]], jnp.int32), jnp.asarray([10], jnp.int32)
    eager = sk.paged_attention(q, k_pages, v_pages, table, lens, causal=True)
    traced = jax.jit(lambda a: sk.paged_attention(a, k_pages, v_pages, table, lens,
                                                  causal=True))(q)
    np.testing.assert_allclose(traced, eager, rtol=1e-12, atol=1e-14)


def test_a_repeated_call_compiles_nothing(caplog):
    """Eager calls (and eager ``grad``) hand JAX the same callback each time: JAX compiles a
    callback's call once per callback object, so a new one at every call was compiled at every
    call (milliseconds for a microsecond kernel).  Concrete arrays outside any transformation
    skip the callback altogether."""
    x = _rand(4, 6)
    t = jnp.asarray([1, 2, 0, 5])
    q = _rand(1, 2, 5, 8, seed=1)
    calls = [
        lambda: sk.softmax(x, axis=-1),
        lambda: sk.log_softmax(x, axis=0),
        lambda: sk.logsumexp(x, axis=-1, b=x * x),
        lambda: sk.cross_entropy(x, t),
        lambda: sk.softmax_vjp(sk.softmax(x, axis=-1), x, axis=-1),
        lambda: sk.attention(q, q, q, causal=True),
        lambda: sk.attention_vjp(q, q, q, *sk.attention(q, q, q, return_lse=True), q),
        lambda: sk.merge_attention_states(jnp.stack([q, q]), jnp.zeros((2, 1, 2, 5))),
        lambda: jax.grad(lambda a: sk.cross_entropy(a, t))(x),
        lambda: jax.grad(lambda a: jnp.sum(sk.attention(a, q, q) ** 2))(q),
        lambda: jax.grad(lambda a: jnp.sum(sk.logsumexp(a, axis=-1)))(x),
    ]
    for call in calls:
        jax.block_until_ready(call())
    with jax.log_compiles(), caplog.at_level("WARNING"):
        for call in calls:
            caplog.clear()
            jax.block_until_ready(call())
            compiled = [r.getMessage() for r in caplog.records if "Compiling" in r.getMessage()]
            assert not compiled, compiled


def test_operations_without_wrappers_run_concrete_arrays_on_the_host_backend():
    """summarize, merge and paged_attention take concrete JAX arrays to the backend numpy
    arrays get (not the array-API reference op by op), and give JAX arrays equal to its
    results on numpy arrays."""
    from softmaxkit.testing.paged_cases import make_cache

    rng = np.random.default_rng(5)
    x = rng.normal(size=(6, 40))
    values = rng.normal(size=(6, 40, 3))
    where = rng.random((6, 40)) > 0.3
    k64, v64, table, lens = make_cache(rng, [50, 0, 17], 4, 2, 8, 8)
    q = rng.normal(size=(3, 4, 2, 8))
    calls = [
        lambda a: sk.summarize(a[0], axis=-1, where=a[1], values=a[2]),
        lambda a: sk.merge(sk.summarize(a[0][:, :20], values=a[2][:, :20]),
                           sk.summarize(a[0][:, 20:], values=a[2][:, 20:])),
        lambda a: sk.paged_attention(*a[3:], causal=True, return_lse=True),
    ]
    host = (x, where, values, q, k64, v64, table, lens)
    arrays = tuple(jnp.asarray(a) for a in host)
    for call in calls:
        with sk.backend_opts(trace=True) as trace:
            got = call(arrays)
        assert {r.backend for r in trace} == {"numba-cpu"}, trace
        want = call(host)
        got_fields = jax.tree.leaves(got if isinstance(got, tuple) else
                                     (got.max, got.mass, got.numerator))
        want_fields = (want if isinstance(want, tuple) else
                       (want.max, want.mass, want.numerator))
        assert len(got_fields) == len(want_fields)
        for g, w in zip(got_fields, want_fields, strict=True):
            assert isinstance(g, jax.Array)
            np.testing.assert_array_equal(np.asarray(g), w)
