"""The op's Python side, one room: what the compiled extension registers (``csrc/``), and what
Python adds to each op, imported one way down (no module imports one above it):

==============  =====================================================================================
``library``     loads ``dilated_attention._C``; :data:`EXTENSION_ERROR`, :func:`has_kernel`, :func:`cpu_isa`
``checks``      the fake kernels' argument checks: those of ``csrc/checks.h``, with ``_validation``'s rules
``autograd``    what the ops' backwards share: no double backward, forward mode refused by name
``func``        the fixed-length and packed ops under torch.func (``autograd.Function`` + vmap rules)
``fixed``       ``fwd``/``bwd``/``dropout_mask``: fake kernels, autograd formula, :func:`native_forward`
``varlen``      ``varlen_fwd``/``varlen_bwd`` (packed sequences, SPEC section 7)
``piece``       ``piece_fwd``/``piece_bwd`` (the pieces of sequence parallelism)
``slots``       the cache layout ``decode_step`` reads (one slot per key a branch reads) and the plain step
``decode``      ``decode_step`` (one decoding step over a cache, SPEC section 8)
``views``       ``views_fwd``/``views_bwd``: the ``sdpa`` backend's driver in C++ (strided views, fused merge)
==============  =====================================================================================

Importing this package registers every fake kernel and autograd formula. The names below are what
the rest of the package uses.
"""

from __future__ import annotations

from . import views  # noqa: F401  (registers views_fwd/views_bwd: fake kernels, autograd)
from .decode import decode_step, has_decode_kernel
from .fixed import dropout_mask, native_forward
from .library import EXTENSION_ERROR, cpu_isa, dropout_seed_offset, has_kernel, lse_dtype
from .piece import has_piece_kernel, piece_backward, piece_forward
from .varlen import native_varlen_forward

__all__ = [
    "EXTENSION_ERROR",
    "cpu_isa",
    "decode_step",
    "dropout_mask",
    "dropout_seed_offset",
    "has_decode_kernel",
    "has_kernel",
    "has_piece_kernel",
    "lse_dtype",
    "native_forward",
    "native_varlen_forward",
    "piece_backward",
    "piece_forward",
]
