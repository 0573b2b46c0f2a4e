"""Per-call cost of dispatch: ``softmaxkit.softmax`` on a tiny array against its parts.

Prints, in microseconds per call (median of several repeats):

* ``kernel``: the reference softmax kernel called directly on the prepared row array;
* ``choose``: :func:`softmaxkit.registry.choose` alone (the registry's share of a call);
* ``dispatch``: what :func:`softmaxkit.dispatch.run` does besides calling the kernel (the
  Call, the device and dtype of the input, choose);
* ``run``: :func:`softmaxkit.dispatch.run` (the Call, device/dtype lookup, choose, kernel);
* ``softmax``: the public ``softmaxkit.softmax(x, axis=-1)`` (validation, layout, run);

and the differences ``run - kernel`` (what dispatch adds) and ``softmax - kernel`` (what the
whole frontend adds).  Run with ``python benchmarks/dispatch_overhead.py``.
"""

from __future__ import annotations

import argparse
import statistics
import timeit

import array_api_compat
import numpy as np

import softmaxkit
from softmaxkit.dispatch import _dtype_name, run
from softmaxkit.ops import Call
from softmaxkit.reference.rows import softmax as reference_softmax
from softmaxkit.registry import choose, device_type


def per_call_us(fn, number: int, repeat: int) -> float:
    """Median over ``repeat`` runs of the time of one call of ``fn``, in microseconds."""
    fn()  # warm-up: discovery, imports, caches
    times = timeit.repeat(fn, number=number, repeat=repeat)
    return statistics.median(times) / number * 1e6


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Measure and print the per-call figures; returns them by name."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--number", type=int, default=5000, help="calls per repeat")
    parser.add_argument("--repeat", type=int, default=7, help="repeats (the median is kept)")
    opts = parser.parse_args(argv)

    x = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
    xp = array_api_compat.array_namespace(x)
    params = {"x": x, "where": None, "masked": "zero", "out_dtype": x.dtype}
    call = Call(op="softmax", xp=xp, device="cpu", dtype="float32", args=params)

    figures = {
        "kernel": per_call_us(lambda: reference_softmax(xp=xp, **params), opts.number,
                              opts.repeat),
        "choose": per_call_us(lambda: choose(call), opts.number, opts.repeat),
        "dispatch": per_call_us(
            lambda: choose(Call("softmax", xp, device_type(x), _dtype_name(x.dtype), params)),
            opts.number, opts.repeat,
        ),
        "run": per_call_us(lambda: run("softmax", xp, x, None, **params), opts.number,
                           opts.repeat),
        "softmax": per_call_us(lambda: softmaxkit.softmax(x, axis=-1), opts.number,
                               opts.repeat),
    }
    figures["run - kernel"] = figures["run"] - figures["kernel"]
    figures["softmax - kernel"] = figures["softmax"] - figures["kernel"]
    print(f"softmax of a float32 array of shape {x.shape}, numpy {np.__version__}")
    for name, value in figures.items():
        print(f"  {name:<18} {value:8.2f} us")
    return figures


if __name__ == "__main__":
    main()
