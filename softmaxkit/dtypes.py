"""Dtype policy: which floating dtypes are supported, the accumulator rule, the output rule.

This module is the one place where spec/semantics.md section "Dtypes" is decided:

* inputs of a 16-bit or 32-bit floating dtype accumulate in float32, float64 inputs in
  float64; running maxima and sums are never held in a 16-bit type;
* integer and boolean inputs (and Python array-likes) promote to the array library's default
  floating dtype, as SciPy does;
* the output has the (promoted) input dtype unless ``dtype=`` asks for another floating dtype;
* results of two inputs (``logsumexp``'s ``a`` and ``b``) follow the caller's library's own
  promotion (:func:`result_float`);
* complex inputs are rejected.
"""

from __future__ import annotations

from typing import Any

import numpy as np

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
"""Names of the floating dtypes every backend may be asked for, narrowest first."""

# Each format's constants, written out: numpy 2.5's finfo refuses ml_dtypes' bfloat16
UNIT_ROUNDOFF: dict[str, float] = {
    "float64": 2.0**-53,
    "float32": 2.0**-24,
    "bfloat16": 2.0**-8,
    "float16": 2.0**-11,
}
"""Unit roundoff ``u = 2**-p`` of each floating dtype (p = significand bits)."""

TINY: dict[str, float] = {
    "float64": 2.0**-1022,
    "float32": 2.0**-126,
    "bfloat16": 2.0**-126,
    "float16": 2.0**-14,
}
"""Smallest positive normal number of each floating dtype."""

HUGE: dict[str, float] = {
    "float64": (2 - 2.0**-52) * 2.0**1023,
    "float32": (2 - 2.0**-23) * 2.0**127,
    "bfloat16": (2 - 2.0**-7) * 2.0**127,
    "float16": 65504.0,
}
"""Largest finite number of each floating dtype."""


def dtype_name(dtype: Any) -> str:
    """Return the short name of a dtype of any array library (``"float32"``, ``"bfloat16"``).

    Parameters
    ----------
    dtype
        A dtype object of numpy (ml_dtypes included), torch, JAX, CuPy or array_api_strict,
        or a numpy scalar type such as ``numpy.float64`` (what ``xp.float64`` is in numpy).
    """
    # dtype objects are few and hashable: each is named once (numpy's .name is slow);
    # keyed with the type first: array_api_strict warns when its dtypes meet numpy's in ==
    key = (type(dtype), dtype)
    try:
        return _NAMES[key]
    except KeyError:
        name = _NAMES[key] = _name(dtype)
        return name
    except TypeError:  # an unhashable dtype object
        return _name(dtype)


_NAMES: dict[tuple[type, Any], str] = {}


def _name(dtype: Any) -> str:
    name = getattr(dtype, "name", None)
    if isinstance(dtype, type):  # numpy scalar types: np.float64 is a class, not a dtype
        name = dtype.__name__
    elif not isinstance(name, str):
        name = str(dtype)
    # "torch.float32", "array_api_strict.float32", "dtype('float32')"
    name = name.rsplit(".", 1)[-1]
    if name.startswith("dtype("):
        name = name[6:].strip("')\"")
    return name


def is_float(xp: Any, dtype: Any) -> bool:
    """Whether ``dtype`` is one of the supported real floating dtypes."""
    return dtype_name(dtype) in FLOAT_DTYPES


def is_complex(xp: Any, dtype: Any) -> bool:
    """Whether ``dtype`` is a complex floating dtype."""
    return dtype_name(dtype).startswith("complex")


def is_integral(xp: Any, dtype: Any) -> bool:
    """Whether ``dtype`` is a boolean or integer dtype (promoted like SciPy)."""
    name = dtype_name(dtype)
    return name == "bool" or name.startswith(("int", "uint"))


def accumulator_name(name: str) -> str:
    """Name of the accumulator dtype for inputs of dtype ``name``."""
    return "float64" if name == "float64" else "float32"


def accumulator_dtype(xp: Any, dtype: Any) -> Any:
    """The accumulator dtype of ``xp`` for inputs of ``dtype``: float32, or float64 for float64."""
    return xp.float64 if dtype_name(dtype) == "float64" else xp.float32


def default_float(xp: Any, device: Any = None) -> Any:
    """The default real floating dtype of ``xp`` (float64 for numpy, float32 for torch)."""
    info = getattr(xp, "__array_namespace_info__", None)
    if info is not None:
        try:
            return info().default_dtypes(device=device)["real floating"]
        except Exception:  # some libraries reject a device they would accept elsewhere
            return info().default_dtypes()["real floating"]
    return xp.float64


def result_float(xp: Any, device: Any, *types: Any) -> Any:
    """The floating dtype of a result computed from inputs of dtypes ``types``.

    The library's own promotion decides (``xp.result_type``: torch keeps float32 with integer
    operands, numpy widens float32 with int64 to float64); a result that would be integral
    becomes the default floating dtype.  Where the library refuses to promote floating with
    integer dtypes (array_api_strict), integers count as the default floating dtype, as in
    SciPy.
    """
    try:
        promoted = xp.result_type(*types)
    except Exception:  # a library without mixed-kind promotion
        promoted = None
    if promoted is not None and is_float(xp, promoted):
        return promoted
    floats = [t for t in types if is_float(xp, t)]
    if len(floats) < len(types):
        floats.append(default_float(xp, device))
    return xp.result_type(*floats)


def lookup(xp: Any, name: str) -> Any:
    """The dtype object of ``xp`` called ``name``; bfloat16 comes from ml_dtypes for numpy."""
    dtype = getattr(xp, name, None)
    if dtype is None and getattr(xp, "float32", None) is np.float32:
        # a namespace over numpy's dtypes that omits some of them (Dask's has no float16)
        dtype = getattr(np, name, None)
    if dtype is None and name == "bfloat16":
        import ml_dtypes  # numpy and libraries built on it spell bfloat16 through ml_dtypes

        dtype = ml_dtypes.bfloat16
    if dtype is None:
        raise TypeError(f"this array library has no {name} dtype")
    return dtype


def output_dtype(xp: Any, input_dtype: Any, requested: Any, argument: str = "dtype") -> Any:
    """The output dtype: ``requested`` when given (a floating dtype), else ``input_dtype``."""
    if requested is None:
        return input_dtype
    if isinstance(requested, str):
        if requested not in FLOAT_DTYPES:
            raise TypeError(
                f"{argument}={requested!r} is not supported: expected one of {FLOAT_DTYPES}"
            )
        return lookup(xp, requested)
    if not is_float(xp, requested):
        raise TypeError(
            f"{argument}={requested!r} is not supported: expected a real floating dtype "
            f"({', '.join(FLOAT_DTYPES)})"
        )
    return requested
