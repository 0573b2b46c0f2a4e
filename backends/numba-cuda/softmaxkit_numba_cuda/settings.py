"""The backend's settings: one frozen object, read from the environment once, and whether
Numba's CUDA simulator is asked for.

Every setting has a default that the benchmarks chose; the environment variables exist for
tuning on a GPU (backends/numba-cuda/README.md lists them).  Nothing else in the backend
reads the environment.  Tests pass their own :class:`Settings` (``SETTINGS.replace(...)``)
to the adapters of :mod:`.rows` instead of setting variables.

``SETTINGS`` is read at its first use (``from .settings import SETTINGS``), not when this
module is imported: the manifest imports this module for :func:`simulator_requested`, and a
mistyped tuning variable must fail the first kernel call, as it always has, not make the
registry skip the backend.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

PREFIX = "SOFTMAXKIT_NUMBA_CUDA_"


@dataclasses.dataclass(frozen=True)
class Settings:
    """How rows are laid out on the device (see :mod:`.plan`).

    Attributes
    ----------
    plan : tuple of int or None
        ``(threads, slots)`` forced on every row kernel (``PLAN="threads,slots"``).
    stage_plan : tuple of int or None
        ``(threads, slots)`` forced on the rows staged in shared memory only
        (``STAGE_PLAN``).
    staged : bool
        Whether rows that the register plan splits are staged in shared memory (``STAGED``;
        ``0``: the register kernels serve every row).
    cluster : str
        Thread-block clusters (``CLUSTER``): ``""`` clusters rows of 2 to 8 chunks, ``"0"``
        none (the chunks exchange through device memory), ``"N"`` rows of up to N chunks (at
        most 16), ``"all"`` also rows of one chunk (a cluster of one block, the form the
        simulator runs).
    persist : str
        The persistent grid of clusters (``PERSIST``): ``""`` for rows of 9 to 32 chunks,
        ``"0"`` off, ``"all"`` also shorter rows (rows of one chunk as clusters of one
        block in the simulator), ``"wide"`` 128 KB chunks instead of two clusters a row.
    """

    plan: tuple[int, int] | None = None
    stage_plan: tuple[int, int] | None = None
    staged: bool = True
    cluster: str = ""
    persist: str = ""

    def replace(self, **changes: object) -> Settings:
        """A copy with ``changes`` applied."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> Settings:
        """The settings named by the ``SOFTMAXKIT_NUMBA_CUDA_*`` variables of ``environ``."""

        def get(name: str) -> str:
            return environ.get(PREFIX + name, "").strip()

        return cls(plan=_pair(PREFIX + "PLAN", get("PLAN")),
                   stage_plan=_pair(PREFIX + "STAGE_PLAN", get("STAGE_PLAN")),
                   staged=get("STAGED") != "0", cluster=_choice(
                       PREFIX + "CLUSTER", get("CLUSTER"), ("", "0", "all"), digits=True),
                   persist=_choice(PREFIX + "PERSIST", get("PERSIST"), ("", "0", "1", "all",
                                                                         "wide")))


def _pair(name: str, value: str) -> tuple[int, int] | None:
    if not value:
        return None
    try:
        threads, slots = (int(v) for v in value.split(",")[:2])
    except ValueError:
        raise ValueError(f"{name}={value!r}: expected 'threads,slots'") from None
    return threads, slots


def _choice(name: str, value: str, allowed: tuple[str, ...], digits: bool = False) -> str:
    if value in allowed or (digits and value.isdigit()):
        return value
    raise ValueError(f"{name}={value!r}: expected one of {allowed}"
                     + (" or a number" if digits else ""))


def simulator_requested(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``NUMBA_ENABLE_CUDASIM`` asks for Numba's CUDA simulator.

    Read at each call (the manifest is asked again after the variable changes); numba itself
    reads the variable once, at its first import.
    """
    value = (os.environ if environ is None else environ).get("NUMBA_ENABLE_CUDASIM", "0")
    return value not in ("", "0")


def __getattr__(name: str) -> Settings:
    # SETTINGS, the settings of this process: parsed once, at its first use (see above)
    if name == "SETTINGS":
        settings = Settings.from_environ(os.environ)
        globals()["SETTINGS"] = settings
        return settings
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
