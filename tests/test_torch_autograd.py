"""PyTorch autograd through softmaxkit's custom operators.

References: torch.autograd.gradcheck (central finite differences of the forward, float64) for
every operation and policy, and torch's own autograd of the equivalent torch code in float64
for float32 / bfloat16 gradients.  torch.compile: zero graph breaks for a transformer block.
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

import softmaxkit as sk  # noqa: E402
from softmaxkit.frameworks.torch import DoubleBackwardError  # noqa: E402
from softmaxkit.testing.tolerance import TOLERANCES  # noqa: E402

f64 = torch.float64


def _randn(*shape, seed=0, dtype=f64, grad=True):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tuple(shape), generator=g, dtype=dtype).requires_grad_(grad)


def _gradcheck(fn, *inputs):
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-7, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# gradcheck, float64


@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
@pytest.mark.parametrize("axis", [-1, 0, (0, 2), None])
def test_gradcheck_softmax_family(op, axis):
    fn = getattr(sk, op)
    _gradcheck(lambda x: fn(x, axis), _randn(3, 4, 5))


@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
def test_gradcheck_masked_rows_have_zero_gradient(op):
    x = _randn(4, 6)
    where = torch.rand(4, 6, generator=torch.Generator().manual_seed(1)) > 0.4
    where[2] = False  # a fully masked row
    fn = getattr(sk, op)
    # log_softmax is -inf at excluded positions; the cotangent is taken on the allowed ones
    _gradcheck(lambda x: torch.where(where, fn(x, -1, where=where), 0.0), x)
    y = fn(x, -1, where=where)
    (g,) = torch.autograd.grad(torch.where(where, y, 0.0).sum(), x)
    assert torch.all(g[2] == 0) and torch.all(g[~where] == 0)


def test_gradcheck_logsumexp():
    x = _randn(3, 4, 5)
    _gradcheck(lambda x: sk.logsumexp(x, axis=1), x)
    _gradcheck(lambda x: sk.logsumexp(x, axis=(0, 2), keepdims=True), x)
    _gradcheck(lambda x: sk.logsumexp(x), x)
    where = torch.ones(3, 4, 5, dtype=torch.bool)
    where[:, 1] = False
    where[0] = False  # empty rows: lse = -inf, gradient 0
    _gradcheck(lambda x: sk.logsumexp(x, axis=1, where=where)[1:], x)
    (g,) = torch.autograd.grad(sk.logsumexp(x, axis=1, where=where)[1:].sum(), x)
    assert torch.all(g[0] == 0) and torch.all(g[:, 1] == 0)


def test_gradcheck_logsumexp_weights():
    x = _randn(3, 5)
    b = torch.rand(1, 5, generator=torch.Generator().manual_seed(2), dtype=f64) + 0.1
    b = b.requires_grad_()
    _gradcheck(lambda x, b: sk.logsumexp(x, axis=-1, b=b), x, b)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("ignore_index,smoothing", [(None, 0.0), (2, 0.0), (-100, 0.1)])
def test_gradcheck_cross_entropy_index(reduction, ignore_index, smoothing):
    x = _randn(6, 5)
    target = torch.tensor([0, 2, 4, 1, 2, 3])
    if ignore_index == -100:
        target[1] = -100
    _gradcheck(
        lambda x: sk.cross_entropy(x, target, reduction=reduction, ignore_index=ignore_index,
                                   label_smoothing=smoothing), x,
    )


def test_gradcheck_cross_entropy_axis_where_and_probs():
    x = _randn(2, 5, 3)  # classes on axis 1
    target = torch.tensor([[0, 4, 1], [3, 3, 0]])
    where = torch.ones(2, 5, 3, dtype=torch.bool)
    where[:, 2] = False
    _gradcheck(lambda x: sk.cross_entropy(x, target, axis=1, where=where,
                                          label_smoothing=0.2), x)
    probs = torch.softmax(_randn(2, 5, 3, seed=3, grad=False), dim=1)
    _gradcheck(lambda x: sk.cross_entropy(x, probs, axis=1, reduction="sum"), x)


def _qkv(hq, hk, lq, lk, d=4, dv=3, lead=(), seed=0, dtype=f64):
    return (_randn(*lead, hq, lq, d, seed=seed, dtype=dtype),
            _randn(*lead, hk, lk, d, seed=seed + 1, dtype=dtype),
            _randn(*lead, hk, lk, dv, seed=seed + 2, dtype=dtype))


ATTENTION_CASES = {
    "plain": dict(),
    "causal-bottom-right": dict(causal=True),
    "causal-top-left": dict(causal="top_left"),
    "window": dict(window=(1, 0)),
    "window-top-left": dict(window=(2, 1), causal="top_left"),
    "softcap": dict(softcap=2.0, scale=0.9),
    "mask": dict(mask="mask"),
}


@pytest.mark.parametrize("case", list(ATTENTION_CASES))
@pytest.mark.parametrize("lq,lk", [(3, 5), (5, 3)])
def test_gradcheck_attention(case, lq, lk):
    q, k, v = _qkv(4, 2, lq, lk)  # grouped-query: 4 query heads over 2 key heads
    kw = dict(ATTENTION_CASES[case])
    if kw.get("mask") == "mask":
        kw["mask"] = torch.rand(lq, lk, generator=torch.Generator().manual_seed(5)) > 0.3
        kw["mask"][1] = False  # a query row with no allowed key: zero gradient
    _gradcheck(lambda q, k, v: sk.attention(q, k, v, **kw), q, k, v)
    # the lse is differentiable too (an empty row's lse is the constant -inf)
    def with_lse(q, k, v):
        out, lse = sk.attention(q, k, v, return_lse=True, **kw)
        return out, torch.where(torch.isfinite(lse), lse, 0.0)

    _gradcheck(with_lse, q, k, v)


def test_gradcheck_attention_broadcast_lead_and_base2_lse():
    q = _randn(2, 2, 3, 4)
    k = _randn(1, 1, 5, 4, seed=1)  # broadcast over the batch and shared by both heads
    v = _randn(1, 1, 5, 2, seed=2)
    _gradcheck(lambda q, k, v: sk.attention(q, k, v, causal=True, return_lse=True,
                                            lse_base=2), q, k, v)


def test_gradcheck_merge_attention():
    outs, lses = _randn(3, 2, 4, 5), _randn(3, 2, 4, seed=1)
    with torch.no_grad():
        lses[1, 0, 2] = -math.inf  # an empty part
    _gradcheck(lambda o, s: sk.merge_attention_states(o, s), outs, lses)
    _gradcheck(lambda o, s: sk.merge_attention_states(o, s, axis=1, lse_base=2), outs, lses)
    a, b = _randn(4, 5), _randn(4, 5, seed=1)
    la, lb = _randn(4, seed=2), _randn(4, seed=3)
    _gradcheck(lambda a, la, b, lb: sk.merge_attention(a, la, b, lb), a, la, b, lb)


def test_split_kv_attention_trains_like_full_attention():
    """Gradients through two partial attentions and their merge equal full attention's."""
    q, k, v = _qkv(2, 1, 3, 6)
    full = sk.attention(q, k, v)
    parts = [sk.attention(q, k[..., i:i + 3, :], v[..., i:i + 3, :], return_lse=True)
             for i in (0, 3)]
    merged, _ = sk.merge_attention(parts[0][0], parts[0][1], parts[1][0], parts[1][1])
    g_full = torch.autograd.grad(full.square().sum(), (q, k, v))
    g_split = torch.autograd.grad(merged.square().sum(), (q, k, v))
    for a, b in zip(g_full, g_split, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("used", ["out", "lse", "both"])
@pytest.mark.parametrize("op", ["attention", "varlen_attention"])
def test_a_returned_lse_reaches_the_backward_only_when_the_loss_uses_it(monkeypatch, op, used):
    """An lse that is returned but unused gives no cotangent (None, not zeros) and the
    backend's VJP no ``dlse``; a used one reaches it as ``dlse``; the gradients equal the
    float64 definition's."""
    import importlib

    module = importlib.import_module(f"softmaxkit.{op.split('_')[0]}")
    seen = []
    run = module.run

    def recorded(name, *a, **kw):
        if name.endswith("_vjp"):
            seen.append("dlse" if kw["dlse"] is not None else "")
        return run(name, *a, **kw)

    monkeypatch.setattr(module, "run", recorded)
    q, k, v = _qkv(2, 1, 5, 7)  # [H, L, D]
    if op == "attention":
        out, lse = sk.attention(q, k, v, causal=True, return_lse=True)
    else:  # one packed sequence: [T, H, D]
        cu_q, cu_k = torch.tensor([0, 5]), torch.tensor([0, 7])
        out, lse = sk.varlen_attention(*(a.transpose(0, 1) for a in (q, k, v)), cu_q, cu_k,
                                       causal=True, return_lse=True)
        out, lse = out.transpose(0, 1), lse.transpose(0, 1)

    def loss(out, lse):
        return {"out": out.square().sum(), "lse": lse.sum(),
                "both": out.square().sum() + lse.sum()}[used]

    grads = torch.autograd.grad(loss(out, lse), (q, k, v), allow_unused=True)
    assert seen == ["" if used == "out" else "dlse"]
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])  # the key head broadcasts
    s = s.masked_fill(torch.ones(5, 7, dtype=torch.bool).tril(2).logical_not(), -math.inf)
    want_out = torch.softmax(s, dim=-1) @ v
    wants = torch.autograd.grad(loss(want_out, torch.logsumexp(s, dim=-1)), (q, k, v),
                                allow_unused=True)
    for got, want in zip(grads, wants, strict=True):
        if want is None:  # v does not reach the lse
            assert got is None or not got.abs().max()
        else:
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# float32 / bfloat16 against torch's own autograd


def _torch_attention(q, k, v, causal=None, window=(-1, -1)):
    """Equivalent torch code: GQA by repetition, boolean mask, empty rows give 0."""
    g = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(g, dim=-3), v.repeat_interleave(g, dim=-3)
    lq, lk = q.shape[-2], k.shape[-2]
    i = torch.arange(lq)[:, None] + (0 if causal == "top_left" else lk - lq)
    j = torch.arange(lk)[None, :]
    allowed = torch.ones(lq, lk, dtype=torch.bool)
    if causal:
        allowed &= j <= i
    if window[0] >= 0:
        allowed &= j >= i - window[0]
    if window[1] >= 0:
        allowed &= j <= i + window[1]
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    p = torch.softmax(s.masked_fill(~allowed, -math.inf), dim=-1)
    return torch.nan_to_num(p, nan=0.0) @ v


def _check_against_torch(sk_fn, torch_fn, inputs64, dtype):
    """sk's gradient in ``dtype`` is as close to the float64 gradient as torch's in ``dtype``."""
    cot = None
    grads = {}
    for name, fn, dt in (("ref", torch_fn, f64), ("torch", torch_fn, dtype), ("sk", sk_fn, dtype)):
        xs = [x.detach().to(dt).requires_grad_() for x in inputs64]
        y = fn(*xs)
        if cot is None:
            cot = _randn(*y.shape, seed=9, grad=False)
        grads[name] = torch.autograd.grad(y, xs, cot.to(y.dtype))
    rtol, atol = TOLERANCES["float32" if dtype == torch.float32 else "bfloat16"]
    for ref, mine, theirs in zip(grads["ref"], grads["sk"], grads["torch"], strict=True):
        assert mine.dtype == dtype
        err = (mine.double() - ref).abs().max().item()
        torch_err = (theirs.double() - ref).abs().max().item()
        scale = ref.abs().max().item()
        assert err <= max(2 * torch_err, 4 * (rtol * scale + atol)), (err, torch_err)


DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_gradients_match_torch(dtype):
    x = _randn(4, 33, grad=False)
    _check_against_torch(lambda x: sk.softmax(x, -1), lambda x: torch.softmax(x, -1), [x], dtype)
    _check_against_torch(lambda x: sk.log_softmax(x, -1),
                         lambda x: torch.log_softmax(x, -1), [x], dtype)
    _check_against_torch(lambda x: sk.logsumexp(x, -1),
                         lambda x: torch.logsumexp(x, -1), [x], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cross_entropy_gradient_matches_torch(dtype):
    x = _randn(8, 37, grad=False) * 3
    target = torch.tensor([0, 5, 36, -100, 7, 7, 1, 20])
    kw = dict(ignore_index=-100, label_smoothing=0.1)
    _check_against_torch(lambda x: sk.cross_entropy(x, target, **kw),
                         lambda x: F.cross_entropy(x, target, **kw), [x], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), ("top_left", (3, 0))])
def test_attention_gradients_match_torch(dtype, causal, window):
    q, k, v = (a.detach() for a in _qkv(4, 2, 6, 9, d=8, dv=8))
    _check_against_torch(
        lambda q, k, v: sk.attention(q, k, v, causal=causal, window=window),
        lambda q, k, v: _torch_attention(q, k, v, causal, window), [q, k, v], dtype,
    )


# ---------------------------------------------------------------------------------------------
# the gradient is never dropped; what cannot be differentiated says so


def test_requires_grad_is_kept_and_plain_calls_stay_plain():
    x = _randn(2, 3)
    for y in (sk.softmax(x), sk.log_softmax(x, 0), sk.logsumexp(x, 1),
              sk.cross_entropy(x, torch.tensor([0, 2])), sk.attention(x[None], x[None], x[None]),
              sk.merge_attention(x, x[:, 0], x, x[:, 1])[0]):
        assert y.requires_grad and y.grad_fn is not None
    with torch.no_grad():
        assert sk.softmax(x).grad_fn is None
    assert sk.softmax(x.detach()).grad_fn is None


_FORWARDS_AND_VJPS = {
    "softmax": (lambda x: sk.softmax(x, -1), "softmax_vjp"),
    "log_softmax": (lambda x: sk.log_softmax(x, -1), "log_softmax_vjp"),
    "logsumexp": (lambda x: sk.logsumexp(x, -1), "softmax"),  # its gradient is a softmax
    "attention": (lambda x: sk.attention(x[None], x[None], x[None]), "attention_vjp"),
    "merge_attention": (lambda x: sk.merge_attention(x, x[:, 0], x, x[:, 1])[0],
                        "merge_attention_vjp"),
    "varlen_attention": (lambda x: sk.varlen_attention(
        x[:, None], x[:, None], x[:, None], torch.tensor([0, 1, 4]), torch.tensor([0, 2, 4])),
        "varlen_attention_vjp"),
}


@pytest.mark.parametrize("op", sorted(_FORWARDS_AND_VJPS))
def test_the_backward_runs_under_the_options_of_its_forward(op):
    """Autograd runs a CUDA backward on a device thread, where the caller's context is absent;
    a backward run on another thread, outside any context, must still obey (and be traced by)
    the options of its forward call, and compute the same gradient."""
    import threading

    forward, vjp = _FORWARDS_AND_VJPS[op]
    x = _randn(4, 3, seed=5)
    (want,) = torch.autograd.grad(forward(x).square().sum(), x)
    with sk.backend_opts(prioritize="reference", trace=True) as trace:
        loss = forward(x).square().sum()
    forward_records = len(trace)
    got = []
    thread = threading.Thread(target=lambda: got.extend(torch.autograd.grad(loss, x)))
    thread.start()
    thread.join()
    backward = trace[forward_records:]
    assert [r.op for r in backward] == [vjp]
    assert {r.backend for r in trace} == {"reference"}
    torch.testing.assert_close(got[0], want, rtol=1e-12, atol=1e-12)


def test_double_backward_raises_naming_the_operation():
    x = _randn(2, 3)
    (g,) = torch.autograd.grad(sk.softmax(x, -1)[:, 0].sum(), x, create_graph=True)
    assert g.requires_grad
    with pytest.raises(DoubleBackwardError, match="softmax_vjp"):
        g.sum().backward()
    q, k, v = _qkv(2, 1, 3, 4)
    gq, _, _ = torch.autograd.grad(sk.attention(q, k, v).sum(), (q, k, v), create_graph=True)
    with pytest.raises(DoubleBackwardError, match="attention_vjp"):
        gq.sum().backward()


def test_eager_calls_record_the_operators_formula_and_match_the_operators():
    """An eager differentiable call records its operator's formula as a
    ``torch.autograd.Function`` (named ``<operator>_eager``), whose backward runs the vjp
    operator's Function in turn; values and gradients equal those of the custom operator
    called directly.  Under a dispatch mode (fake tensors) the custom operator itself runs."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from softmaxkit.frameworks import torch as ops

    x, target = _randn(3, 5), torch.tensor([0, 4, 2])
    calls = [
        ("softmax", lambda: sk.softmax(x, -1), lambda: ops.softmax_op(
            x, [1], None, None, "zero", None)),
        ("log_softmax", lambda: sk.log_softmax(x, -1), lambda: ops.log_softmax_op(
            x, [1], None, None, "zero", None)),
        ("logsumexp", lambda: sk.logsumexp(x, -1), lambda: ops.logsumexp_op(
            x, [1], None, False, None, None)),
        ("cross_entropy", lambda: sk.cross_entropy(x, target), lambda: ops.cross_entropy_op(
            x, target, 1, "mean", None, 0.0, None, True, None)[0]),
    ]
    for name, eager, operator in calls:
        got, want = eager(), operator()
        assert got.grad_fn.name() == f"{name}_eagerBackward"
        assert want.grad_fn.name().startswith(f"GeneratedBackwardFor_softmaxkit_{name}")
        cot = torch.randn_like(want)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        torch.testing.assert_close(torch.autograd.grad(got, x, cot)[0],
                                   torch.autograd.grad(want, x, cot)[0], rtol=0, atol=0)
    q, k, v = _qkv(2, 1, 3, 4)
    out = sk.attention(q, k, v, causal=True)
    assert out.grad_fn.name() == "attention_eagerBackward"
    gq, gk, gv = torch.autograd.grad(out.sum(), (q, k, v), create_graph=True)
    assert gq.grad_fn.name() == "attention_vjp_eagerBackward"
    want, _ = ops.attention_op(q, k, v, None, "bottom_right", [-1, -1], None, None, "float32",
                               None, False)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    for got_g, want_g in zip((gq, gk, gv), torch.autograd.grad(want.sum(), (q, k, v)),
                             strict=True):
        torch.testing.assert_close(got_g, want_g, rtol=0, atol=0)
    with FakeTensorMode():
        fake = torch.randn(3, 5, requires_grad=True)
        assert sk.softmax(fake, -1).grad_fn.name().startswith(
            "GeneratedBackwardFor_softmaxkit_softmax")


def _lse_loss(out, lse):
    """A loss using both of attention's outputs (an empty row's lse, -inf, left out)."""
    return out.square().sum() + torch.where(torch.isfinite(lse), lse, 0.0).sum()


def _holds_tensor(obj, depth=0):
    """Whether ``obj`` (a gradient state: its slots, tuples, lists, dicts) refers to a
    tensor, which would keep it alive until the backward whatever autograd saved."""
    if isinstance(obj, torch.Tensor):
        return True
    if depth > 3:
        return False
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_holds_tensor(a, depth + 1) for a in obj)
    slots = getattr(type(obj), "__slots__", ())
    return any(_holds_tensor(getattr(obj, n), depth + 1) for n in slots)


def test_an_eager_backward_runs_the_forwards_checked_call(monkeypatch):
    """Without ``create_graph`` an eager attention's backward runs the call its forward
    checked and laid out, not the vjp operator; its gradients equal the operator path's for
    broadcast leading dimensions, grouped heads, promoted dtypes, a mask with an empty row and
    a used lse."""
    import importlib

    from softmaxkit.frameworks import torch as ops

    module = importlib.import_module("softmaxkit.frameworks.torch.attention")
    q = _randn(2, 1, 4, 5, 4, dtype=torch.float32)  # promoted with k, v to float64
    _, k, v = _qkv(4, 2, 5, 6, lead=(3,))  # leading dims broadcast to (2, 3)
    mask = torch.rand(5, 6, generator=torch.Generator().manual_seed(3)) > 0.4
    mask[2] = False
    args = (0.7, "top_left", [-1, -1], mask, 1.5, "float32", None, True)

    want = torch.autograd.grad(_lse_loss(*ops.attention_op(q, k, v, *args)), (q, k, v))
    vjp = module.attention_vjp_op
    monkeypatch.setattr(module, "attention_vjp_op", lambda *a: pytest.fail("vjp operator ran"))
    out, lse = sk.attention(q, k, v, scale=0.7, causal="top_left", mask=mask, softcap=1.5,
                            return_lse=True)
    got = torch.autograd.grad(_lse_loss(out, lse), (q, k, v))
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not _holds_tensor(out.grad_fn.state)  # the backward gets autograd's saved ones
    # a NaN cotangent on the row with no key (lse -inf) is never read, on either path
    cots = (torch.randn_like(out),
            torch.randn_like(lse).index_fill(-1, torch.tensor([2]), math.nan))
    monkeypatch.setattr(module, "attention_vjp_op", vjp)
    want_nan = torch.autograd.grad(ops.attention_op(q, k, v, *args), (q, k, v), cots)
    monkeypatch.setattr(module, "attention_vjp_op", lambda *a: pytest.fail("vjp operator ran"))
    out, lse = sk.attention(q, k, v, scale=0.7, causal="top_left", mask=mask, softcap=1.5,
                            return_lse=True)
    for a, b in zip(torch.autograd.grad((out, lse), (q, k, v), cots), want_nan, strict=True):
        assert bool(torch.isfinite(a).all())
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # under activation checkpointing the backward gets recomputed operands, same gradients
    checkpointed = torch.utils.checkpoint.checkpoint(
        lambda q, k, v: _lse_loss(*sk.attention(q, k, v, scale=0.7, causal="top_left",
                                                mask=mask, softcap=1.5, return_lse=True)),
        q, k, v, use_reentrant=False)
    for a, b in zip(torch.autograd.grad(checkpointed, (q, k, v)), want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    monkeypatch.setattr(module, "attention_vjp_op", vjp)
    out = sk.attention(q, k, v, mask=mask)  # a second derivative asked for: the operator
    (gq,) = torch.autograd.grad(out.sum(), q, create_graph=True)
    assert gq.grad_fn.name() == "attention_vjp_eagerBackward"


def test_an_eager_packed_backward_reads_the_lengths_once(monkeypatch):
    """An eager varlen_attention's backward runs its forward's checked call: the cumulative
    lengths are read (on a GPU: copied to the host) by the forward alone, not the vjp
    operator; its gradients equal the operator path's, a used lse and an empty sequence
    included."""
    import importlib

    from softmaxkit.frameworks import torch as ops

    module = importlib.import_module("softmaxkit.frameworks.torch.attention")
    varlen = importlib.import_module("softmaxkit.varlen")
    q = _randn(9, 4, 4, dtype=torch.float32)  # promoted with k, v to float64
    k, v = _randn(11, 2, 4, seed=1), _randn(11, 2, 3, seed=2)
    cu_q, cu_k = torch.tensor([0, 4, 4, 9]), torch.tensor([0, 3, 6, 11])
    args = (cu_q, cu_k, 0.8, "bottom_right", [-1, -1], None, "float32", None, True)

    want = torch.autograd.grad(_lse_loss(*ops.varlen_attention_op(q, k, v, *args)), (q, k, v))
    reads = []
    check = varlen.check_seqlens
    monkeypatch.setattr(varlen, "check_seqlens", lambda *a: reads.append(1) or check(*a))
    monkeypatch.setattr(module, "varlen_attention_vjp_op",
                        lambda *a: pytest.fail("vjp operator ran"))
    out, lse = sk.varlen_attention(q, k, v, cu_q, cu_k, scale=0.8, causal=True,
                                   return_lse=True)
    assert not _holds_tensor(out.grad_fn.state)
    got = torch.autograd.grad(_lse_loss(out, lse), (q, k, v))
    assert reads == [1]
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# torch.func.jacfwd scripts a helper of its own with torch.jit, which warns of its deprecation
@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_torch_func_transforms_run_the_librarys_formulas():
    """``torch.func.grad`` and ``torch.func.vjp`` through softmaxkit's operations give the
    gradients autograd gives (torch's own where it has the operation, float64); forward mode
    (``jvp``, ``jacfwd``) raises an error naming the operation, and a second derivative raises
    ``DoubleBackwardError``."""
    from softmaxkit.frameworks.torch import DoubleBackwardError

    x, target = _randn(3, 5, grad=False), torch.tensor([0, 4, 2])
    q, k, v = (a.detach() for a in _qkv(4, 2, 5, 6, lead=(2,)))
    cu_q, cu_k = torch.tensor([0, 2, 5]), torch.tensor([0, 4, 6])

    cases = [
        (lambda x: sk.softmax(x, -1).square().sum(),
         lambda x: torch.softmax(x, -1).square().sum(), (x,)),
        (lambda x: sk.log_softmax(x, -1).square().sum(),
         lambda x: torch.log_softmax(x, -1).square().sum(), (x,)),
        (lambda x: sk.logsumexp(x, -1).sum(), lambda x: torch.logsumexp(x, -1).sum(), (x,)),
        (lambda x: sk.cross_entropy(x, target), lambda x: F.cross_entropy(x, target), (x,)),
        (lambda q, k, v: sk.attention(q, k, v, causal=True).square().sum(),
         lambda q, k, v: F.scaled_dot_product_attention(
             q, k, v, is_causal=False, enable_gqa=True,
             attn_mask=torch.ones(5, 6, dtype=torch.bool).tril(1)).square().sum(), (q, k, v)),
        (lambda q, k, v: _lse_loss(*sk.attention(q, k, v, causal=True, return_lse=True)),
         None, (q, k, v)),
        (lambda q, k, v: _lse_loss(*sk.varlen_attention(q[0].transpose(0, 1), k[0].transpose(
            0, 1), v[0].transpose(0, 1), cu_q, cu_k, causal=True, return_lse=True)),
         None, (q, k, v)),
    ]
    for ours, theirs, inputs in cases:
        argnums = tuple(range(len(inputs)))
        got = torch.func.grad(ours, argnums=argnums)(*inputs)
        if theirs is not None:
            want = torch.func.grad(theirs, argnums=argnums)(*inputs)
        else:  # the eager autograd path, itself checked against float64 above
            leaves = tuple(a.clone().requires_grad_() for a in inputs)
            want = torch.autograd.grad(ours(*leaves), leaves)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    out, pullback = torch.func.vjp(lambda x: sk.softmax(x, -1), x)
    cot = torch.randn_like(out)
    torch.testing.assert_close(pullback(cot)[0], torch.func.vjp(
        lambda x: torch.softmax(x, -1), x)[1](cot)[0], rtol=1e-12, atol=1e-12)
    with pytest.raises(NotImplementedError, match="softmaxkit.softmax has no forward-mode"):
        torch.func.jacfwd(lambda x: sk.softmax(x, -1))(x)
    with pytest.raises(NotImplementedError, match="softmaxkit.attention has no forward-mode"):
        torch.func.jvp(lambda q: sk.attention(q, k, v), (q,), (q,))
    with pytest.raises(NotImplementedError, match="softmaxkit.varlen_attention has no vmap "
                       "rule .*packed sequences are a batch already"):
        torch.func.vmap(lambda q: sk.varlen_attention(
            q.transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cu_q, cu_k))(q)
    with pytest.raises(DoubleBackwardError, match="softmax_vjp"):
        torch.func.grad(lambda x: torch.func.grad(
            lambda y: sk.softmax(y, -1).square().sum())(x).sum())(x)


def _loop(fn, in_dims, *args):
    """``fn`` example by example: the reference for ``torch.func.vmap(fn, in_dims)``."""
    n = next(a.shape[d] for a, d in zip(args, in_dims, strict=True) if d is not None)
    results = [fn(*(a if d is None else a.select(d, i) for a, d in zip(args, in_dims,
                                                                        strict=True)))
               for i in range(n)]
    if isinstance(results[0], tuple):
        return tuple(torch.stack(r) for r in zip(*results, strict=True))
    return torch.stack(results)


def _close(got, want, rtol=1e-10, atol=1e-12):
    got, want = (g if isinstance(g, tuple) else (g,) for g in (got, want))
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol)


def _vmap_cases():
    """``(fn, inputs, in_dims)`` for every differentiable operation and its VJP: axes counted
    from either end, in_dims other than 0, unbatched operands beside batched ones."""
    x = _randn(4, 3, 5, grad=False)  # 4 examples of [3, 5] (or 3 of [4, 5] for in_dims 1)
    where = torch.rand(4, 5, generator=torch.Generator().manual_seed(3)) > 0.3
    where[0] = False  # a fully masked row in one example
    b = torch.rand(4, 3, 5, generator=torch.Generator().manual_seed(4), dtype=f64)
    labels = torch.tensor([[0, 4, 2], [-100, -100, -100], [3, -100, 1], [1, 1, 0]])
    allowed = torch.rand(4, 5, generator=torch.Generator().manual_seed(5)) > 0.3
    allowed[:, 0] = True  # target mass on allowed classes only: finite losses
    probs = torch.softmax(_randn(4, 3, 5, seed=5, grad=False).masked_fill(
        ~allowed[:, None], -math.inf), -1)
    q, k, v = (a.detach() for a in _qkv(4, 2, 5, 6, lead=(3,)))  # 3 examples of q
    out, lse = sk.attention(q, k[0], v[0], causal=True, return_lse=True)
    mask = torch.rand(3, 5, 6, generator=torch.Generator().manual_seed(6)) > 0.3
    outs, lses = _randn(3, 4, 2, 3, seed=7, grad=False), _randn(3, 4, 2, seed=8, grad=False)
    return {
        "softmax": (lambda x: sk.softmax(x, -1), (x,), (0,)),
        "softmax-axis0-in_dims1": (lambda x: sk.softmax(x, 0), (x,), (1,)),
        "log_softmax-all-where": (lambda x, w: sk.log_softmax(x, where=w), (x[0], where),
                                  (None, 0)),
        "softmax_vjp": (lambda p, g: sk.softmax_vjp(p, g, 1, where=where[1]),
                        (torch.softmax(x, -1), b.permute(1, 2, 0)), (0, 2)),
        "log_softmax_vjp": (lambda p, g: sk.log_softmax_vjp(p, g, -1),
                            (torch.log_softmax(x[0], -1), b), (None, 0)),
        "logsumexp-b": (lambda a, b: sk.logsumexp(a, 0, b=b, keepdims=True),
                        (x[0], b.transpose(0, 1)), (None, 1)),
        "logsumexp-all": (lambda a: sk.logsumexp(a), (x,), (2,)),
        "cross_entropy-mean-ignored": (
            lambda x, t: sk.cross_entropy(x, t, ignore_index=-100), (x, labels), (0, 0)),
        "cross_entropy-axis0-grad": (
            lambda x, t: sk.cross_entropy(x, t, 0, reduction="sum", label_smoothing=0.1,
                                          return_grad=True),
            (x.transpose(1, 2), labels.clamp(min=0)), (0, 0)),
        "cross_entropy-probs-where": (
            lambda x, p, w: sk.cross_entropy(x, p, where=w, reduction="none"),
            (x[0], probs, allowed.T), (None, 0, 1)),
        "attention-kv-unbatched": (
            lambda q: sk.attention(q, k[0], v[0], causal=True, return_lse=True), (q,), (0,)),
        "attention-mask-in_dims1": (
            lambda k, m: sk.attention(q[0], k, v[0], mask=m), (k.transpose(0, 1), mask),
            (1, 0)),
        "attention_vjp": (
            lambda q, out, lse, dout: sk.attention_vjp(q, k[0], v[0], out, lse, dout,
                                                       dlse=lse.exp(), causal=True),
            (q, out, lse, out.flip(0)), (0, 0, 0, 0)),
        "merge_attention_states": (
            lambda o, s: sk.merge_attention_states(o, s, axis=-1), (outs, lses), (0, 0)),
        "merge_attention_vjp-axis1": (
            lambda o, s, g: sk.merge_attention_vjp(o, s, g, s[:, 0], axis=1),
            (outs[0], lses, outs[:, :, 0]), (None, 0, 0)),
    }


@pytest.mark.parametrize("case", list(_vmap_cases()))
def test_vmap_matches_a_loop(case):
    """``torch.func.vmap`` of every operation equals the operation example by example (the
    eager path, checked above against torch and finite differences)."""
    fn, inputs, in_dims = _vmap_cases()[case]
    _close(torch.func.vmap(fn, in_dims=in_dims)(*inputs), _loop(fn, in_dims, *inputs))


@pytest.mark.parametrize("case", list(_vmap_cases()))
def test_compiled_vmap_runs_one_call_and_matches_a_loop(case):
    """Under ``torch.compile`` the operator itself runs where a vmap holds it: its own rule
    (``register_vmap``) makes the batch one call, not torch's loop over the examples."""
    fn, inputs, in_dims = _vmap_cases()[case]
    torch._dynamo.reset()  # each case compiles afresh, under no other case's guards
    compiled = torch.compile(torch.func.vmap(fn, in_dims=in_dims), backend="aot_eager")
    with sk.backend_opts(trace=True) as trace:
        got = compiled(*inputs)
    assert len(trace) == 1, [entry.op for entry in trace]
    _close(got, _loop(fn, in_dims, *inputs))


def test_vmap_matches_torch_and_nests():
    x = _randn(2, 3, 4, 5, grad=False)
    _close(torch.func.vmap(lambda x: sk.softmax(x, 1), in_dims=1)(x),
           torch.softmax(x, 2).movedim(1, 0))
    _close(torch.func.vmap(torch.func.vmap(lambda x: sk.logsumexp(x, 0)), in_dims=(2,))(x),
           torch.logsumexp(x, 1).permute(1, 0, 2))
    q, k, v = (a.detach() for a in _qkv(4, 2, 5, 6, lead=(3,)))
    _close(torch.func.vmap(lambda q, k, v: sk.attention(q, k, v), in_dims=(0, None, None))(
        q, k[0], v[0]), F.scaled_dot_product_attention(q, k[0], v[0], enable_gqa=True))


def _merge_reference(outs, lses, axis=0):
    lse = torch.logsumexp(lses, axis)
    return (torch.exp(lses - lse.unsqueeze(axis)).unsqueeze(-1) * outs).sum(axis), lse


def _attention_lse_reference(q, k, v, mask):
    """scaled_dot_product_attention and the rows' logsumexp of the masked scores (float64)."""
    g = q.shape[-3] // k.shape[-3]
    scores = q @ k.repeat_interleave(g, -3).transpose(-1, -2) / math.sqrt(q.shape[-1])
    lse = torch.logsumexp(scores.masked_fill(~mask, -math.inf), -1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True), lse


def test_jacrev_matches_torchs_jacobian():
    """``torch.func.jacrev`` (its backward vmapped over the Jacobian's rows) equals
    ``torch.autograd.functional.jacobian`` of torch's own operation in float64."""
    jacobian = torch.autograd.functional.jacobian
    x = _randn(3, 4, grad=False)
    target, probs = torch.tensor([1, 0, 3]), torch.softmax(_randn(3, 4, seed=1, grad=False), 0)
    cases = [
        (lambda x: sk.softmax(x, 0), lambda x: torch.softmax(x, 0)),
        (lambda x: sk.log_softmax(x, -1), lambda x: torch.log_softmax(x, -1)),
        (lambda x: sk.logsumexp(x, 1), lambda x: torch.logsumexp(x, 1)),
        (lambda x: sk.cross_entropy(x, target), lambda x: F.cross_entropy(x, target)),
        (lambda x: sk.cross_entropy(x, probs, 0, reduction="none"),
         lambda x: F.cross_entropy(x.T, probs.T, reduction="none")),
    ]
    for ours, theirs in cases:
        _close(torch.func.jacrev(ours)(x), jacobian(theirs, x))
    q, k, v = (a.detach() for a in _qkv(4, 2, 3, 5, lead=(2,)))
    mask = torch.ones(3, 5, dtype=torch.bool).tril(2)  # causal, bottom-right
    got = torch.func.jacrev(lambda q, k, v: sk.attention(q, k, v, causal=True, return_lse=True),
                            argnums=(0, 1, 2))(q, k, v)
    want = jacobian(lambda q, k, v: _attention_lse_reference(q, k, v, mask), (q, k, v))
    for a, b in zip(got, want, strict=True):
        _close(a, b)
    outs, lses = _randn(3, 2, 4, seed=2, grad=False), _randn(3, 2, seed=3, grad=False)
    got = torch.func.jacrev(sk.merge_attention_states, argnums=(0, 1))(outs, lses)
    for a, b in zip(got, jacobian(_merge_reference, (outs, lses)), strict=True):
        _close(a, b)


def test_per_sample_gradients_match_a_loop():
    """``torch.func.vmap(torch.func.grad(loss))`` equals ``torch.autograd.grad`` example by
    example: a mean of cross_entropy is each example's own (its own count of rows that are not
    ignored), and an operand shared by all examples (in_dims None) gets each example's own
    gradient, as it does with the gradient taken outside the vmap."""
    def per_example(loss, inputs, in_dims, argnums=(0,)):
        grads = []
        for i in range(next(a.shape[d] for a, d in zip(inputs, in_dims, strict=True)
                            if d is not None)):
            args = [(a if d is None else a.select(d, i)).clone()
                    for a, d in zip(inputs, in_dims, strict=True)]
            leaves = [args[j].requires_grad_() for j in argnums]
            grads.append(torch.autograd.grad(loss(*args), leaves))
        return tuple(torch.stack(g) for g in zip(*grads, strict=True))

    x = _randn(4, 3, 5, grad=False)
    labels = torch.tensor([[0, 4, 2], [-100, -100, -100], [3, -100, 1], [1, 1, 0]])
    q, k, v = (a.detach() for a in _qkv(4, 2, 5, 6, lead=(3,)))
    every = slice(None)
    cases = [  # (ours, torch's, inputs, in_dims, argnums, the examples torch's agrees on)
        (lambda x, t: sk.cross_entropy(x, t, ignore_index=-100),
         lambda x, t: F.cross_entropy(x, t, ignore_index=-100), (x, labels), (0, 0), (0,),
         [0, 2, 3]),  # example 1 has no row counted: torch's mean is NaN, softmaxkit's 0
        (lambda x, t: sk.cross_entropy(x, t, 0, label_smoothing=0.2),
         lambda x, t: F.cross_entropy(x.T, t, label_smoothing=0.2),
         (x, torch.randint(0, 4, (3, 5), generator=torch.Generator().manual_seed(1))), (1, 0),
         (0,), every),
        (lambda x: sk.logsumexp(x, (0, 1)), lambda x: torch.logsumexp(x, (0, 1)), (x,), (2,),
         (0,), every),
        (lambda q, k, v: _lse_loss(*sk.attention(q, k, v, causal=True, return_lse=True)),
         lambda q, k, v: _lse_loss(*_attention_lse_reference(
             q, k, v, torch.ones(5, 6, dtype=torch.bool).tril(1))),
         (q, k[0], v[0]), (0, None, None), (0, 1, 2), every),
    ]
    for ours, theirs, inputs, in_dims, argnums, agreed in cases:
        got = torch.func.vmap(torch.func.grad(ours, argnums=argnums), in_dims=in_dims)(*inputs)
        want = per_example(ours, inputs, in_dims, argnums)
        torchs = per_example(theirs, inputs, in_dims, argnums)
        for a, b, c in zip(got, want, torchs, strict=True):
            _close(a, b)
            _close(a[agreed], c[agreed])

    def batch_loss(x):  # the gradient outside the vmap: of the sum of per-example means
        return torch.func.vmap(
            lambda x, t: sk.cross_entropy(x, t, ignore_index=-100))(x, labels).sum()

    _close(torch.func.grad(batch_loss)(x), per_example(
        lambda x, t: sk.cross_entropy(x, t, ignore_index=-100), (x, labels), (0, 0))[0])


def test_underivable_arguments_raise():
    x = _randn(2, 3)
    with pytest.raises(NotImplementedError, match="return_sign"):
        sk.logsumexp(x, 1, return_sign=True)
    probs = torch.softmax(_randn(2, 3, seed=1), -1)
    with pytest.raises(NotImplementedError, match="cross_entropy.*target"):
        sk.cross_entropy(x, probs)


def test_cross_entropy_return_grad_under_autograd():
    x = _randn(3, 4)
    target = torch.tensor([1, 0, 3])
    loss, dlogits = sk.cross_entropy(x, target, return_grad=True)
    (g,) = torch.autograd.grad(loss, x)
    torch.testing.assert_close(dlogits, g)
    torch.testing.assert_close(g, torch.autograd.grad(F.cross_entropy(x, target), x)[0])


# ---------------------------------------------------------------------------------------------
# torch.compile


class _Block(torch.nn.Module):
    """A transformer block with grouped-query causal attention and a fused loss."""

    def __init__(self, vocab=13, dim=16, heads=4, kv_heads=2):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.embed = torch.nn.Embedding(vocab, dim)
        self.q = torch.nn.Linear(dim, dim)
        self.kv = torch.nn.Linear(dim, 2 * kv_heads * self.hd)
        self.o = torch.nn.Linear(dim, dim)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, tokens, targets):
        x = self.embed(tokens)
        b, n, _ = x.shape
        q = self.q(x).view(b, n, self.heads, self.hd).transpose(1, 2)
        k, v = self.kv(x).view(b, n, 2, self.kv_heads, self.hd).permute(2, 0, 3, 1, 4)
        a = sk.attention(q, k, v, causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, n, -1))
        return sk.cross_entropy(self.head(x), targets, ignore_index=-100)


def test_torch_compile_traces_without_graph_breaks():
    torch.manual_seed(0)
    model = _Block()
    tokens = torch.randint(0, 13, (2, 6))
    targets = torch.randint(0, 13, (2, 6))
    targets[0, 0] = -100
    explained = torch._dynamo.explain(model)(tokens, targets)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    model(tokens, targets).backward()
    eager = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    compiled(tokens, targets).backward()
    for a, p in zip(eager, model.parameters(), strict=True):
        torch.testing.assert_close(p.grad, a)


def test_operators_pass_opcheck():
    """Schema, fake implementations and autograd registrations agree with the real operators."""
    from softmaxkit.frameworks import torch as ops

    x, where = _randn(3, 5), torch.ones(3, 5, dtype=torch.bool)
    where[1, 2] = False
    q, k, v = _qkv(4, 2, 3, 5)
    outs, lses = _randn(2, 3, 4), _randn(2, 3, seed=1)
    samples = [
        (ops.softmax_op, (x, [1], where, None, "zero", None)),
        (ops.log_softmax_op, (x, None, None, torch.float64, "zero", None)),
        (ops.softmax_vjp_op, (x.detach(), x.detach() * 2, [1], where, None)),
        (ops.logsumexp_op, (x, [0], None, True, where, None)),
        (ops.cross_entropy_op, (x, torch.tensor([0, 4, 2]), 1, "mean", None, 0.1, None, True,
                                None)),
        (ops.attention_op, (q, k, v, None, "bottom_right", [-1, -1], None, None, "float32",
                            None, True)),
        (ops.merge_attention_op, (outs, lses, 0, None)),
    ]
    out, lse = sk.attention(q.detach(), k.detach(), v.detach(), causal=True, return_lse=True)
    for dlse in (None, torch.randn_like(lse)):
        samples.append((ops.attention_vjp_op, (q.detach(), k.detach(), v.detach(), out, lse,
                                               out, dlse, None, "bottom_right", [-1, -1], None,
                                               None, "float32", None)))
    for op, args in samples:
        torch.library.opcheck(op, args)


def test_summaries_refuse_tensors_requiring_grad():
    x = _randn(2, 5)
    with pytest.raises(NotImplementedError, match="summarize"):
        sk.summarize(x)
    with torch.no_grad():
        s = sk.summarize(x)
    assert s.max.grad_fn is None
    fields = sk.Summary(s.max.clone().requires_grad_(), s.mass, None)
    with pytest.raises(NotImplementedError, match="merge"):
        sk.merge(fields, s)
