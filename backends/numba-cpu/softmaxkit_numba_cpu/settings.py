"""The backend's settings: one frozen object, read from the environment once, at import.

backends/numba-cpu/README.md lists them.  Nothing else in the backend reads the environment.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

PREFIX = "SOFTMAXKIT_NUMBA_CPU_"


@dataclasses.dataclass(frozen=True)
class Settings:
    """The backend's tunables.

    Attributes
    ----------
    reuse : bool
        Whether large results are carved from buffers kept for reuse (:mod:`.buffers`;
        ``SOFTMAXKIT_NUMBA_CPU_REUSE=0`` turns it off).
    """

    reuse: bool = True

    def replace(self, **changes: object) -> Settings:
        """A copy with ``changes`` applied."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> Settings:
        """The settings named by the ``SOFTMAXKIT_NUMBA_CPU_*`` variables of ``environ``."""
        return cls(reuse=environ.get(PREFIX + "REUSE", "1").strip() != "0")


SETTINGS = Settings.from_environ(os.environ)
"""The settings of this process."""
