"""Per-call cost of dispatch: ``softmaxkit.softmax`` on a tiny array against its parts.

Prints, in microseconds per call (median of several repeats), on the reference path (the
reference backend prioritized, so every figure runs the same kernel):

* ``kernel``: the reference softmax kernel called directly on the prepared row array;
* ``choose``: :func:`softmaxkit.registry.choose` alone (the registry's share of a call);
* ``dispatch``: what :func:`softmaxkit.dispatch.run` does besides calling the kernel (the
  Call, the device and dtype of the input, choose);
* ``run``: :func:`softmaxkit.dispatch.run` (dispatch and kernel);
* ``softmax``: the public ``softmaxkit.softmax(x, axis=-1)`` (validation, layout, run);

then, on the automatic path, the backend that wins, ``choose`` there, and the cost of each
installed backend's ``can_run`` / ``should_run`` hooks for this call (hooks run on every
call, before the winner is known).  Run with ``python benchmarks/dispatch_overhead.py``.
"""

from __future__ import annotations

import argparse
import statistics
import timeit
from collections.abc import Callable
from typing import Any

import array_api_compat
import numpy as np

import softmaxkit
from softmaxkit.dispatch import run
from softmaxkit.dtypes import dtype_name
from softmaxkit.ops import Call
from softmaxkit.reference.rows import softmax as reference_softmax
from softmaxkit.registry import backend_opts, choose, device_type, registry


def per_call_us(fn: Callable[[], Any], number: int, repeat: int) -> float:
    """Median over ``repeat`` runs of the time of one call of ``fn``, in microseconds."""
    fn()  # warm-up: discovery, imports, caches, compilation
    times = timeit.repeat(fn, number=number, repeat=repeat)
    return statistics.median(times) / number * 1e6


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Measure and print the per-call figures; returns them by name."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--number", type=int, default=2000, help="calls per repeat")
    parser.add_argument("--repeat", type=int, default=9, help="repeats (the median is kept)")
    opts = parser.parse_args(argv)
    n, r = opts.number, opts.repeat

    x = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
    xp = array_api_compat.array_namespace(x)
    params = {"x": x, "where": None, "masked": "zero", "out_dtype": x.dtype}
    call = Call(op="softmax", xp=xp, device="cpu", dtype="float32", args=params)

    def dispatch() -> Any:
        return choose(Call("softmax", xp, device_type(x), dtype_name(x.dtype), params))

    with backend_opts(prioritize="reference"):
        figures = {
            "kernel": per_call_us(lambda: reference_softmax(xp=xp, **params), n, r),
            "choose": per_call_us(lambda: choose(call), n, r),
            "dispatch": per_call_us(dispatch, n, r),
            "run": per_call_us(lambda: run("softmax", xp, x, None, **params), n, r),
            "softmax": per_call_us(lambda: softmaxkit.softmax(x, axis=-1), n, r),
        }
    figures["run - kernel"] = figures["run"] - figures["kernel"]
    figures["softmax - run"] = figures["softmax"] - figures["run"]
    print(f"softmax of a float32 array of shape {x.shape}, numpy {np.__version__}")
    print("reference path (reference prioritized):")
    for name, value in figures.items():
        print(f"  {name:<22} {value:8.2f} us")

    winner = choose(call)[0].name
    figures["auto choose"] = per_call_us(lambda: choose(call), n, r)
    figures["auto softmax"] = per_call_us(lambda: softmaxkit.softmax(x, axis=-1), n, r)
    print(f"automatic path (runs on {winner}):")
    print(f"  {'choose':<22} {figures['auto choose']:8.2f} us")
    print(f"  {'softmax':<22} {figures['auto softmax']:8.2f} us")
    print("hooks per call, by backend:")
    for name, backend in registry().items():
        if backend.serves_key("softmax", "cpu", "float32") and (
            backend.can_run_path or backend.should_run_path
        ):
            cost = per_call_us(lambda b=backend: (b.can_run(call), b.should_run(call)), n, r)
            figures[f"hooks {name}"] = cost
            print(f"  {name:<22} {cost:8.2f} us")
    return figures


if __name__ == "__main__":
    main()
