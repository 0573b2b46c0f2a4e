"""The backend's settings: one frozen object, read from the environment once, at import.

``SOFTMAXKIT_CUPY_PAGED=1`` lets the paged split-KV decode kernel serve ``paged_attention``.
It is off by default until the kernel has passed ``tools/paged_check.py`` on a GPU: it is
built and compiled in CI, but has not yet run on hardware.  Nothing else in the backend reads
the environment.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

PREFIX = "SOFTMAXKIT_CUPY_"


@dataclasses.dataclass(frozen=True)
class Settings:
    """What the backend serves beyond its verified kernels.

    Attributes
    ----------
    paged : bool
        Whether ``paged_attention`` runs on the paged decode kernel (``PAGED=1``).
    """

    paged: bool = False

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> Settings:
        """The settings named by the ``SOFTMAXKIT_CUPY_*`` variables of ``environ``."""
        paged = environ.get(PREFIX + "PAGED", "").strip()
        if paged not in ("", "0", "1"):
            raise ValueError(f"{PREFIX}PAGED={paged!r}: expected 0 or 1")
        return cls(paged=paged == "1")


SETTINGS = Settings.from_environ(os.environ)
