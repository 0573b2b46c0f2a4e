"""softmaxkit: the stable-softmax family, fast and exact on every array library and device.

The public API follows SciPy's signatures where SciPy has the function, so array-agnostic
code can swap the import.  Every call is dispatched by operation, device and dtype to the best
installed backend (:func:`backends` lists them); the semantics at every edge are fixed by
spec/semantics.md and are the same on every backend.
"""

from .arguments import AxisError, EmptyRowError
from .attention import (
    attention,
    attention_vjp,
    merge_attention,
    merge_attention_states,
    merge_attention_vjp,
)
from .paged import paged_attention
from .registry import BackendWarning, NoBackendError, backend_opts, backends
from .rows import cross_entropy, log_softmax, log_softmax_vjp, logsumexp, softmax, softmax_vjp
from .summary import Summary, merge, summarize
from .varlen import varlen_attention, varlen_attention_vjp

__version__ = "0.1.0"

__all__ = [
    "AxisError",
    "BackendWarning",
    "EmptyRowError",
    "NoBackendError",
    "Summary",
    "attention",
    "attention_vjp",
    "backend_opts",
    "backends",
    "cross_entropy",
    "log_softmax",
    "log_softmax_vjp",
    "logsumexp",
    "merge",
    "merge_attention",
    "merge_attention_states",
    "merge_attention_vjp",
    "paged_attention",
    "softmax",
    "softmax_vjp",
    "summarize",
    "varlen_attention",
    "varlen_attention_vjp",
]
