"""A pytest plugin that runs SciPy's own tests of logsumexp, softmax and log_softmax against
softmaxkit: ``scipy.special``'s three functions are replaced by softmaxkit's, the swap a user
makes, before SciPy's test module imports them.

Load it with ``-p swap_softmaxkit`` (this directory on ``PYTHONPATH``) and ``SCIPY_ARRAY_API``
set.  SciPy's test helpers look the tested functions up in SciPy's capability table, so the
replacements are entered there with the capabilities of the functions they replace.
"""

from __future__ import annotations

import scipy.special
from scipy._lib._array_api import xp_capabilities_table

import softmaxkit

SWAPPED = ("logsumexp", "softmax", "log_softmax")

for _name in SWAPPED:
    _theirs, _ours = getattr(scipy.special, _name), getattr(softmaxkit, _name)
    xp_capabilities_table[_ours] = xp_capabilities_table[_theirs]
    setattr(scipy.special, _name, _ours)
