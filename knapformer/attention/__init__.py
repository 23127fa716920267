"""Varlen attention backends (no torch.distributed here).

Main API: :func:`varlen_attention`, :func:`varlen_cross_attention`, :data:`BACKENDS`,
:func:`available_backends`.
"""

from knapformer.attention.varlen import (
    BACKENDS,
    VarlenAttention,
    available_backends,
    flash_available,
    varlen_attention,
    varlen_cross_attention,
)

__all__ = [
    "BACKENDS",
    "VarlenAttention",
    "available_backends",
    "flash_available",
    "varlen_attention",
    "varlen_cross_attention",
]
