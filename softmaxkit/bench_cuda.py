"""The CUDA side of the benchmarks: the eager table's shapes and its headline summary, the
cross-entropy figures, and the float64 references and checks computed on the device.

``softmaxkit bench --device cuda`` runs :func:`softmaxkit.bench.run` on :data:`EAGER_SHAPES`
and :data:`EAGER_DTYPES`, then prints :func:`eager_summary` and :func:`cross_entropy_eager`
(docs/benchmarks-eager.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

from .bench import Result, Run, _poison, _trace, cuda_timer, time_calls

EAGER_SHAPES: tuple[tuple[int, int], ...] = ((32768, 4096), (4096, 32768), (262144, 128),
                                             (256, 524288))
"""The row shapes of the CUDA eager table (``softmaxkit bench --device cuda``)."""

EAGER_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")

CROSS_ENTROPY_SHAPES: tuple[tuple[int, int], ...] = ((4096, 32768), (4096, 128256))
"""Logits of the CUDA cross-entropy (forward and fused gradient) figures, in bfloat16."""


def eager_summary(result: Run) -> str:
    """The headline of a CUDA run: softmax and log_softmax as % of the copy bandwidth measured
    in the same run, logsumexp as torch's time over softmaxkit's, next to torch."""
    lines = [f"eager calls, default dispatch, {cuda_timer()}; copy = device-to-device copy "
             "of the same array in this run",
             f"{'op':<12} {'dtype':<9} {'shape':<12} {'softmaxkit':>12} {'torch':>12}  ran on"]
    cases: dict[tuple, dict[str, Result]] = {}
    for r in result.results:
        cases.setdefault((r.op, r.dtype, r.shape), {})[r.contender] = r
    for (op, dtype, shape), by in cases.items():
        ours, torch, copy = by.get("softmaxkit"), by.get("torch"), by.get("copy")
        if ours is None or math.isnan(ours.seconds):
            sk_fig = t_fig = "n/a"
        elif op == "logsumexp":
            sk_fig = ("" if torch is None or math.isnan(torch.seconds)
                      else f"{torch.seconds / ours.seconds:.2f}x torch")
            t_fig = "1.00x"
        else:
            ceiling = copy.gbps if copy is not None else math.nan
            sk_fig = f"{ours.gbps / ceiling:.0%} copy"
            t_fig = ("" if torch is None or math.isnan(torch.gbps)
                     else f"{torch.gbps / ceiling:.0%} copy")
        note = ours.note if ours is not None else ""
        lines.append(f"{op:<12} {dtype:<9} {'x'.join(map(str, shape)):<12} {sk_fig:>12} "
                     f"{t_fig:>12}  {note}")
    return "\n".join(lines)


def cross_entropy_eager(shapes: Iterable[tuple[int, int]] = CROSS_ENTROPY_SHAPES,
                        dtype: str = "bfloat16", seed: int = 0, device: str = "cuda") -> str:
    """Cross-entropy with its fused gradient against torch's forward + backward, on CUDA.

    Both are checked against a float64 reference on the device first (loss and gradient of
    the mean loss), then timed eagerly; the figure is torch's time over softmaxkit's.
    """
    import torch

    import softmaxkit as sk

    from .testing.tolerance import TOLERANCES

    rtol, atol = TOLERANCES[dtype]
    gen = torch.Generator(device=device).manual_seed(seed)
    timer = cuda_timer() if device != "cpu" else "wall clock"
    lines = [f"cross_entropy + gradient, {dtype}, eager, {timer} "
             "(torch: F.cross_entropy forward + backward)"]
    for rows, n in shapes:
        x = (torch.randn(rows, n, device=device, generator=gen) * 3).to(getattr(torch, dtype))
        t = torch.randint(0, n, (rows,), device=device, generator=gen)
        x64 = x.double()
        lse = torch.logsumexp(x64, -1)
        loss64 = (lse - x64.gather(1, t[:, None])[:, 0]).mean()
        grad64 = torch.softmax(x64, -1)
        grad64[torch.arange(rows, device=device), t] -= 1.0
        grad64 /= rows
        _poison(x, x.numel() * x.element_size())
        with _trace() as trace:
            loss, grad = sk.cross_entropy(x, t, return_grad=True)
        bound = atol + rtol * (grad64.abs() + 1.0 / rows)
        ok = bool(torch.all((grad.double() - grad64).abs() <= bound)) and abs(
            float(loss) - float(loss64)) <= 4 * (atol + rtol * (abs(float(loss64)) + 10))
        del x64, grad64
        leaf = x.detach().requires_grad_()

        def torch_fwd_bwd(leaf: Any = leaf, t: Any = t) -> None:
            leaf.grad = None
            torch.nn.functional.cross_entropy(leaf, t).backward()

        def ours(x: Any = x, t: Any = t) -> Any:
            return sk.cross_entropy(x, t, return_grad=True)

        on = ", ".join(dict.fromkeys(r.backend for r in trace))
        if not ok:
            lines.append(f"{rows}x{n}: softmaxkit's loss or gradient is wrong (on {on}); "
                         "not timed")
            continue
        ours_s, torch_s = time_calls([ours, torch_fwd_bwd], device, repeats=5)
        lines.append(f"{rows}x{n}: softmaxkit {ours_s * 1e6:.0f} us, torch "
                     f"{torch_s * 1e6:.0f} us: {torch_s / ours_s:.2f}x torch (on {on})")
    return "\n".join(lines)


def torch64(a: Any) -> Any:
    """A CUDA array (torch or CuPy) as a float64 torch tensor on its device."""
    import torch

    t = a.detach() if hasattr(a, "detach") else torch.from_dlpack(a)
    return t.double()


def torch_reference(op: str, x: Any) -> Any:
    """The float64 result of ``op`` on a float64 torch tensor, on its device."""
    import torch

    fns: dict[str, Callable[..., Any]] = {
        "softmax": torch.softmax, "log_softmax": torch.log_softmax,
        "logsumexp": torch.logsumexp}
    return fns[op](x, -1)


def torch_max_error(got: Any, expected: Any) -> float:
    """The largest difference between ``got`` and ``expected`` where ``expected`` is finite."""
    import torch

    finite = torch.isfinite(expected)
    diff = (got - expected).abs()[finite]
    return float(diff.max()) if diff.numel() else 0.0


def check_torch(op: str, got: Any, expected: Any, x: Any, dtype: str) -> None:
    """Refuse to time a wrong result, as :func:`softmaxkit.bench._check` does, on the device:
    ``got``, ``expected`` and ``x`` are float64 torch tensors."""
    import torch

    from .testing.tolerance import TOLERANCES

    rtol, atol = TOLERANCES[dtype]
    if op == "softmax":
        bound = atol + rtol * expected.abs()
    else:
        scale = x.abs().amax(dim=-1, keepdim=op != "logsumexp")
        bound = atol + rtol * (expected.abs() + scale)
    err = (got - expected).abs()
    bad = ~(err <= bound)  # NaN in a result fails too
    if bool(torch.any(bad)):
        worst = float(err[bad].nan_to_num(float("inf")).max())
        raise AssertionError(f"bench {op} [{dtype}]: error {worst:.3g} exceeds its bound; "
                             "softmaxkit is not timed on a wrong result")
