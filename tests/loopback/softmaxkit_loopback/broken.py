"""A deliberately broken backend, for proving that the conformance kit catches rule breakers.

It is not registered through the entry point: a test registers it with
``softmaxkit.registry.register(broken.manifest())`` and expects ``check_backend`` to fail the
cases of the rules it breaks, and only those.  Each kernel is the reference's except for one
mistake a fast kernel could plausibly make:

* ``logsumexp`` multiplies by the weights instead of excluding ``b = 0`` (it treats a zero
  weight as the smallest positive one), so ``b = 0`` next to ``+inf`` or NaN leaks in;
* ``softmax`` turns a +inf row into a one-hot (uniform over its +inf positions) instead of
  NaN.
"""

from __future__ import annotations

from typing import Any

import array_api_compat.numpy as npx
import numpy as np

from softmaxkit.reference import rows

OPS = ("softmax", "logsumexp")


def softmax(*, xp: Any, x: Any, where: Any, masked: str, out_dtype: Any) -> Any:
    """Softmax whose +inf rows put their mass on the +inf positions (the spec says NaN)."""
    p = np.asarray(rows.softmax(npx, x=x, where=where, masked=masked, out_dtype=out_dtype))
    at_inf = np.asarray(x) == np.inf
    if where is not None:
        at_inf &= np.asarray(where)
    count = at_inf.sum(-1, keepdims=True)
    hot = (at_inf / np.maximum(count, 1)).astype(p.dtype)
    return np.where(count > 0, hot, p)


def logsumexp(
    *, xp: Any, x: Any, b: Any, where: Any, return_sign: bool, out_dtype: Any
) -> Any:
    """Logsumexp that weighs a zero-weight position with the smallest positive weight."""
    if b is not None:
        b = np.asarray(b)
        b = np.where(b == 0, np.finfo(b.dtype).smallest_subnormal, b).astype(b.dtype)
    return rows.logsumexp(npx, x=x, b=b, where=where, return_sign=return_sign,
                          out_dtype=out_dtype)


def manifest(name: str = "loopback-broken") -> dict[str, Any]:
    """The broken backend's manifest: two row operations on CPU, opt-in only."""
    return {
        "name": name,
        "serves": [{"ops": list(OPS), "devices": ["cpu"],
                    "dtypes": ["float16", "float32", "float64"]}],
        "kernels": {op: f"{__name__}:{op}" for op in OPS},
        "requires_opt_in": True,
        "can_run": "softmaxkit_loopback.hooks:can_run",
        "install_hint": "pip install ./tests/loopback (from the softmaxkit source tree)",
    }
