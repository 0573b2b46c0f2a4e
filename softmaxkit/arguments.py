"""Validation and normalization of the frontend's arguments.

Every public function validates its arguments here, once, before any backend sees them, so
that each error names the argument at fault and says what was expected, and the caller's
arrays are never modified.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any

import array_api_compat
import numpy as np

from . import dtypes

MASKED_POLICIES = ("zero", "nan", "raise")


class AxisError(ValueError, IndexError):
    """An axis argument is out of range or repeated (like numpy's ``AxisError``)."""


class EmptyRowError(ValueError):
    """A row has no allowed position and the ``masked="raise"`` policy was asked for."""


def namespace(**arrays: Any) -> Any:
    """The array namespace shared by the named arrays; ``None`` values are ignored.

    Python scalars and sequences adopt the namespace of the other arrays (numpy when every
    argument is array-like), like SciPy.  Mixing two array libraries, or two devices, is an
    error that names both arguments.
    """
    found: dict[str, Any] = {}
    for name, value in arrays.items():
        if value is not None and _is_array(value):
            found[name] = value
    if not found:
        return _numpy_namespace()
    names = list(found)
    first = names[0]
    xp = _namespace_of(found[first])
    if len(names) == 1:
        return xp
    for name in names[1:]:
        other = _namespace_of(found[name])
        if other is not xp:
            raise TypeError(
                f"{first} and {name} belong to different array libraries "
                f"({xp.__name__} and {other.__name__}); pass arrays of one library"
            )
    # a JAX array being traced (under jit or grad) has no device yet (None): it takes the
    # device of the computation, so only the devices the arrays already have must agree
    known = [(name, d) for name in names if (d := _device_of(found[name])) is not None]
    for name, other_dev in known[1:]:
        if other_dev != known[0][1]:
            raise ValueError(
                f"{known[0][0]} is on device {known[0][1]} but {name} is on device "
                f"{other_dev}; move them to one device"
            )
    return xp


def _device_of(value: Any) -> Any:
    """``array_api_compat.device(value)``, read directly for torch and CuPy arrays, whose
    ``device`` attribute is it (the generic function's type checks cost more than the rest of
    a small call's validation)."""
    if type(value).__module__.split(".", 1)[0] in ("torch", "cupy"):
        return value.device
    return array_api_compat.device(value)


def _is_array(value: Any) -> bool:
    kind = type(value)
    if kind is np.ndarray or kind in _ARRAY_TYPES:
        return True
    found = array_api_compat.is_array_api_obj(value)
    if found and kind.__module__.split(".", 1)[0] in _FIXED:
        _ARRAY_TYPES.add(kind)  # every instance of these libraries' array types is one
    return found


_ARRAY_TYPES: set[type] = set()


_NAMESPACES: dict[type, Any] = {}
_FIXED = ("numpy", "torch", "cupy")
"""Libraries whose namespace depends on the array's type only, so it is looked up once."""


def _namespace_of(value: Any) -> Any:
    kind = type(value)
    xp = _NAMESPACES.get(kind)
    if xp is None:
        xp = array_api_compat.array_namespace(value)
        if kind.__module__.split(".", 1)[0] in _FIXED:
            _NAMESPACES[kind] = xp
    return xp


def fixed_namespace(xp: Any, x: Any) -> bool:
    """Whether every array of ``x``'s type has namespace ``xp`` (see :data:`_FIXED`)."""
    return _NAMESPACES.get(type(x)) is xp


def checked_key(x: Any, axis: Any) -> tuple[Any, ...] | None:
    """What the checks of a single array ``x`` along ``axis`` depend on, as a hashable key,
    or ``None`` when there is no such key.

    Once ``x`` has passed them (an array of a library whose namespace its type decides, of
    a real floating dtype, ``axis`` valid for its shape), any array of the same type, dtype
    and shape with an equal ``axis`` of the same type passes them with the same outcome.
    Only ``None`` and plain ints are keyed: an ``axis`` equal to an int but of another type
    (``1.0``, ``True``) must still get its error.
    """
    if axis is not None and type(axis) is not int:
        return None
    try:
        return (type(x), x.dtype, x.shape, axis)
    except AttributeError:  # not an array: Python scalars and sequences are converted
        return None


def _numpy_namespace() -> Any:
    return _namespace_of(np.empty(0))


def as_array(xp: Any, value: Any, name: str, like: Any = None) -> Any:
    """``value`` as an array of ``xp``, on the device of ``like`` when given."""
    if _is_array(value):
        return value
    device = None if like is None else array_api_compat.device(like)
    try:
        return xp.asarray(value, device=device)
    except Exception as exc:
        raise TypeError(f"{name} could not be converted to an array: {exc}") from exc


def cast(xp: Any, x: Any, dtype: Any) -> Any:
    """``x`` in ``dtype``: ``x`` itself when it has it (``xp.astype(copy=False)`` costs
    microseconds on a torch tensor even then, which add up in a small call)."""
    return x if x.dtype == dtype else xp.astype(x, dtype, copy=False)


def real(xp: Any, x: Any, name: str) -> Any:
    """``x`` itself if its dtype is real floating, integer or boolean; else a ``TypeError``
    that names ``name``."""
    if dtypes.is_float(xp, x.dtype) or dtypes.is_integral(xp, x.dtype):
        return x
    return floating(xp, x, name)  # raises the error that fits the dtype


def floating(xp: Any, x: Any, name: str) -> Any:
    """``x`` itself if it is real floating; integers and booleans promote to the default float.

    Complex and other dtypes are rejected with an error that names ``name``.
    """
    if dtypes.is_float(xp, x.dtype):
        return x
    if dtypes.is_integral(xp, x.dtype):
        dev = array_api_compat.device(x)
        return xp.astype(x, dtypes.default_float(xp, dev))
    if dtypes.is_complex(xp, x.dtype):
        raise TypeError(
            f"{name} has complex dtype {dtypes.dtype_name(x.dtype)}: softmaxkit defines these "
            "operations for real logits only"
        )
    raise TypeError(
        f"{name} has dtype {dtypes.dtype_name(x.dtype)}: expected a real floating, integer "
        "or boolean dtype"
    )


def attention_operands(
    xp: Any, q: Any, k: Any, v: Any, names: tuple[str, str, str] = ("q", "k", "v")
) -> tuple[Any, Any, Any]:
    """``q``, ``k``, ``v`` as floating arrays of ``xp`` (:func:`floating`), ``k`` and ``v``
    converted on ``q``'s device; ``names`` name them in the errors."""
    q = floating(xp, as_array(xp, q, names[0]), names[0])
    k = floating(xp, as_array(xp, k, names[1], like=q), names[1])
    v = floating(xp, as_array(xp, v, names[2], like=q), names[2])
    return q, k, v


def shaped_floating(xp: Any, value: Any, name: str, shape: tuple[int, ...], like: Any) -> Any:
    """``value`` as a floating array of ``xp`` on ``like``'s device, checked to have ``shape``.

    Raises
    ------
    ValueError
        Any other shape.
    """
    a = floating(xp, as_array(xp, value, name, like=like), name)
    if tuple(a.shape) != shape:
        raise ValueError(f"{name} of shape {tuple(a.shape)} must have shape {shape}")
    return a


def axes(axis: Any, ndim: int, name: str = "axis") -> tuple[int, ...]:
    """Normalize ``axis`` (None, an int or a tuple of ints) to a sorted tuple of axes."""
    if axis is None:
        return tuple(range(ndim))
    items = axis if isinstance(axis, (tuple, list)) else (axis,)
    out = []
    for item in items:
        try:
            index = operator.index(item)
        except TypeError:
            raise TypeError(
                f"{name}={axis!r} is not valid: expected None, an int or a tuple of ints"
            ) from None
        if not -ndim <= index < ndim and not (ndim == 0 and index in (0, -1)):
            raise AxisError(
                f"{name}={axis!r} is out of range for an array of {ndim} dimension(s)"
            )
        out.append(index % ndim if ndim else 0)
    if len(set(out)) != len(out):
        raise AxisError(f"{name}={axis!r} repeats an axis")
    return tuple(sorted(out)) if ndim else ()


def single_axis(axis: Any, ndim: int, name: str = "axis") -> int:
    """Normalize an ``axis`` that must name exactly one axis."""
    if isinstance(axis, (tuple, list)) or axis is None:
        raise TypeError(f"{name}={axis!r} is not valid: expected a single int")
    (index,) = axes(axis, ndim, name) or (0,)
    return index


def boolean(value: Any, name: str, meaning: str) -> Any:
    """Validate that the array ``value`` is boolean; ``meaning`` says what True means."""
    if dtypes.dtype_name(value.dtype) != "bool":
        raise TypeError(
            f"{name} must be a boolean array ({meaning}); "
            f"got dtype {dtypes.dtype_name(value.dtype)}"
        )
    return value


def flag(value: Any, name: str) -> bool:
    """``value`` of a True / False option, or a TypeError naming the option (a string such as
    ``"no"`` is truthy, so it is refused rather than read)."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False; got {value!r}")
    return bool(value)


def mask(xp: Any, where: Any, shape: tuple[int, ...], like: Any, name: str = "where") -> Any:
    """Validate a boolean mask and broadcast it to ``shape`` (a view where possible)."""
    if where is None:
        return None
    where = boolean(as_array(xp, where, name, like=like), name,
                    "True keeps a position, False excludes it")
    return _broadcast(xp, where, shape, name)


def broadcast_operand(xp: Any, value: Any, shape: tuple[int, ...], like: Any, name: str) -> Any:
    """Broadcast a real operand (``b``, a cotangent) to ``shape``, naming it on failure."""
    value = floating(xp, as_array(xp, value, name, like=like), name)
    return _broadcast(xp, value, shape, name)


def _broadcast(xp: Any, value: Any, shape: tuple[int, ...], name: str) -> Any:
    """``value`` broadcast to ``shape`` (``value`` itself when it has that shape already)."""
    if tuple(value.shape) == tuple(shape):
        return value
    try:
        return xp.broadcast_to(value, shape)
    except Exception:
        raise ValueError(
            f"{name} of shape {tuple(value.shape)} does not broadcast to shape {tuple(shape)}"
        ) from None


def masked_policy(masked: Any) -> str:
    """Validate the fully-masked-row policy."""
    if masked not in MASKED_POLICIES:
        raise ValueError(f"masked={masked!r} is not a policy: expected one of {MASKED_POLICIES}")
    return masked


def choice(value: Any, allowed: Sequence[Any], name: str) -> Any:
    """Validate that ``value`` is one of ``allowed``."""
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not valid: expected one of {tuple(allowed)}")
    return value


def finite_scalar(value: Any, name: str, low: float, high: float) -> float:
    """Validate a real scalar in ``[low, high]``."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name}={value!r} is not a real number") from None
    if not (math.isfinite(number) and low <= number <= high):
        raise ValueError(f"{name}={value!r} is out of range: expected a number in [{low}, {high}]")
    return number


# attention's arguments

CAUSAL: dict[Any, str | None] = {False: None, None: None, True: "bottom_right",
                                 "bottom_right": "bottom_right", "top_left": "top_left"}
"""Attention's accepted ``causal`` values and the alignment each names."""


def lse_base(lse_base: Any) -> str:
    """Validate the base of a returned log-sum-exp: ``"e"`` or ``"2"``."""
    if isinstance(lse_base, str) and lse_base in ("e", "2"):
        return lse_base
    if not isinstance(lse_base, (bool, str)) and lse_base in (2, 2.0):
        return "2"
    raise ValueError(f"lse_base={lse_base!r} is not valid: expected 'e' (natural log) or 2")


def empty_lse(empty_lse: Any) -> float:
    """Validate the log-sum-exp of a row with no allowed key: -inf or +inf."""
    value = float(empty_lse)
    if value not in (-math.inf, math.inf):
        raise ValueError(
            f"empty_lse={empty_lse!r} is not valid: expected -inf (softmaxkit, FlashInfer) or "
            "+inf (FlashAttention 2)"
        )
    return value


def causal(causal: Any) -> str | None:
    """Validate ``causal`` of attention: ``None`` (not causal), ``"bottom_right"`` or
    ``"top_left"``."""
    if isinstance(causal, np.bool_):
        causal = bool(causal)
    key = causal if isinstance(causal, (bool, str)) or causal is None else object()
    if key not in CAUSAL:
        raise ValueError(
            f"causal={causal!r} is not valid: expected False, True / 'bottom_right' "
            "(FlashAttention alignment) or 'top_left' (PyTorch SDPA / JAX alignment)"
        )
    return CAUSAL[key]


def window(window: Any) -> tuple[int, int]:
    """Validate a sliding window ``(left, right)``; -1 (or ``None``) is unbounded."""
    if window is None:
        return (-1, -1)
    try:
        left, right = (operator.index(w) for w in window)
    except (TypeError, ValueError):
        raise TypeError(
            f"window={window!r} is not valid: expected (left, right) ints, -1 = unbounded"
        ) from None
    if left < -1 or right < -1:
        raise ValueError(f"window={window!r} is not valid: bounds must be >= -1 (-1 = unbounded)")
    return (left, right)


def softcap(softcap: Any) -> float | None:
    """Validate a logit soft cap (``None`` or 0: none)."""
    if softcap is None:
        return None
    value = finite_scalar(softcap, "softcap", 0.0, math.inf)
    return value or None  # 0 means no cap, as in FlashAttention


def attention_options(
    causal_value: Any, window_value: Any, softcap_value: Any
) -> dict[str, Any]:
    """Validate attention's ``causal``, ``window`` and ``softcap`` together
    (:func:`causal`, :func:`window`, :func:`softcap`), as keyword arguments of a backend call."""
    return {"causal": causal(causal_value), "window": window(window_value),
            "softcap": softcap(softcap_value)}


PRECISIONS = ("float32", "tf32x3", "tf32")
"""Attention's ``precision=`` values, most precise first: the least precision of the products of
float32 inputs a caller accepts (spec "Attention", "Precision")."""


def precision(value: Any, dtype: str) -> str:
    """Validate attention's ``precision`` and give the value a backend receives for inputs of
    ``dtype`` (a dtype name): ``value`` for float32 inputs, ``"float32"`` (no reduction) for
    every other dtype, whose products are already exact in float32 (16-bit) or stay float64."""
    if not isinstance(value, str) or value not in PRECISIONS:
        raise ValueError(f"precision={value!r} is not valid: expected one of {PRECISIONS}")
    return value if dtype == "float32" else "float32"


def grouped_query_heads(hq: int, hk: int, keys_values: str = "k's and v's") -> None:
    """Check that q's ``hq`` heads are a multiple of the keys' and values' ``hk`` heads.

    Parameters
    ----------
    hq, hk : int
        The query heads and the key (and value) heads.
    keys_values : str
        The keys and values, possessive, for the error (``"k_pages' and v_pages'"``).

    Raises
    ------
    ValueError
        ``hk`` is 0 or does not divide ``hq``.
    """
    if hk == 0 or hq % hk:
        raise ValueError(
            f"q's {hq} heads must be a multiple of {keys_values} {hk} heads "
            "(grouped-query attention)"
        )


def attention_scale(scale: Any, d: int) -> float:
    """Validate the attention scale; ``None`` gives ``1 / sqrt(d)``."""
    if scale is None:
        return 1.0 / math.sqrt(d) if d else 1.0
    try:
        value = float(scale)
    except (TypeError, ValueError):
        raise TypeError(f"scale={scale!r} is not a real number") from None
    if not math.isfinite(value):
        raise ValueError(f"scale={scale!r} must be finite")
    return value
