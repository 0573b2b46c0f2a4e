"""PyTorch custom operators for the differentiable operations, with the library's VJPs.

Each operation is one ``torch.library.custom_op`` (namespace ``softmaxkit``) with a fake
implementation for ``torch.compile`` and an autograd formula, so autograd, ``torch.compile``
and CUDA graphs see one opaque operator.  An eager call (nothing tracing or transforming it)
runs the same implementation and formula as a ``torch.autograd.Function``
(``<operator>_eager``), without the custom operator's own dispatch: on the CPU a
differentiable call and its backward cost 70-140 us less (a fifth to a third of a small
call; :func:`.common.call`).  Under a ``torch.func`` transform (``grad``, ``vjp``,
``vmap``, ``jacrev``, ``vmap(grad(...))``) the formula runs as a Function of the form
functorch takes.  Its vmap rule calls the operator once with the vmapped dimension as one
more leading (batch) dimension of every operand, unbatched operands expanded where a result
or gradient needs them per example, axes counted from the start shifted by one
(:func:`.common.batch_first`); a mean of ``cross_entropy`` is each example's own.  The
operator carries the same rule (``register_vmap``) for a vmap under ``torch.compile``.
``varlen_attention`` has no vmap rule (its packing is the batch) and forward mode (``jvp``,
``jacfwd``) raises, naming the operation.  An operator's implementation calls the public
function's plain path (dispatch through the registry, unchanged); its backward calls the
library's own VJP operators on the same backend:

- softmax, log_softmax: ``softmax_vjp`` / ``log_softmax_vjp`` from the saved output;
- logsumexp: the softmax of the input (with weights ``b``: ``b * exp(a - lse)``);
- cross_entropy: the gradient the fused forward computed in the same pass, and nothing else
  (on a GPU its implementation reads nothing back to the host: the mean's count stays on the
  device and labels are not range-checked there, so it can be captured in a CUDA graph);
- attention: ``attention_vjp`` recomputing from the saved ``out`` and ``lse``;
- merge_attention_states: ``merge_attention_vjp``;
- varlen_attention: ``varlen_attention_vjp`` recomputing from the saved ``out`` and ``lse``.

Second derivatives are not implemented: differentiating a backward raises an error that names
the operation.  Arguments that have no gradient formula (for example probabilities as
cross-entropy targets that require grad) raise at the call, never drop the gradient.

The functions below take the public signatures; the public functions hand a call here when
:func:`softmaxkit.frameworks.route` says autograd, ``torch.compile`` or a ``torch.func``
transform could record it.
"""

from .attention import (
    attention,
    attention_op,
    attention_vjp,
    attention_vjp_op,
    merge_attention_op,
    merge_attention_states,
    merge_attention_vjp,
    merge_attention_vjp_op,
    varlen_attention,
    varlen_attention_op,
    varlen_attention_vjp,
    varlen_attention_vjp_op,
)
from .common import DoubleBackwardError
from .rows import (
    cross_entropy,
    cross_entropy_op,
    log_softmax,
    log_softmax_op,
    log_softmax_vjp,
    log_softmax_vjp_op,
    logsumexp,
    logsumexp_op,
    softmax,
    softmax_op,
    softmax_vjp,
    softmax_vjp_op,
)

__all__ = [
    "DoubleBackwardError",
    "attention",
    "attention_op",
    "attention_vjp",
    "attention_vjp_op",
    "cross_entropy",
    "cross_entropy_op",
    "log_softmax",
    "log_softmax_op",
    "log_softmax_vjp",
    "log_softmax_vjp_op",
    "logsumexp",
    "logsumexp_op",
    "merge_attention_op",
    "merge_attention_states",
    "merge_attention_vjp",
    "merge_attention_vjp_op",
    "softmax",
    "softmax_op",
    "softmax_vjp",
    "softmax_vjp_op",
    "varlen_attention",
    "varlen_attention_op",
    "varlen_attention_vjp",
    "varlen_attention_vjp_op",
]
