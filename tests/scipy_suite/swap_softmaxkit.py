"""A pytest plugin that runs SciPy's own tests of logsumexp, softmax and log_softmax against
softmaxkit: ``scipy.special``'s three functions are replaced by softmaxkit's, the swap a user
makes, before SciPy's test module imports them.

Load it with ``-p swap_softmaxkit`` (this directory on ``PYTHONPATH``) and ``SCIPY_ARRAY_API``
set; with ``SOFTMAXKIT_SWAP_RECORD`` naming a file, it writes there which module each swapped
name of ``scipy.special`` comes from.  SciPy's test helpers look the tested functions up in
SciPy's capability table, so the replacements are entered there with the capabilities of the
functions they replace.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

SWAPPED = ("logsumexp", "softmax", "log_softmax")


def pytest_configure(config: Any) -> None:
    # in the hook, not at import: importing this file (a doctest collection) swaps nothing
    import scipy.special
    from scipy._lib._array_api import xp_capabilities_table

    import softmaxkit

    for name in SWAPPED:
        theirs, ours = getattr(scipy.special, name), getattr(softmaxkit, name)
        xp_capabilities_table[ours] = xp_capabilities_table[theirs]
        setattr(scipy.special, name, ours)
    # a record of what scipy.special now holds, for the test that started this run
    record = os.environ.get("SOFTMAXKIT_SWAP_RECORD")
    if record:
        held = {name: getattr(scipy.special, name).__module__ for name in SWAPPED}
        Path(record).write_text(json.dumps(held))
