"""Varlen attention backends (no torch.distributed here).

Main API: :func:`varlen_attention`, :func:`varlen_attention_qk` (separate query and key
bounds: the custom-kernel contract), :func:`varlen_cross_attention`, the backend registry
(:data:`BACKENDS`, :data:`BACKEND_NAMES`, :func:`get_backend`, :func:`available_backends`) and
:class:`Backend`. Names resolve lazily, so the torch-free registry can be imported (by the
config and the CLI) without importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "BACKENDS",
    "BACKEND_NAMES",
    "Backend",
    "VarlenAttention",
    "available_backends",
    "flash_available",
    "get_backend",
    "varlen_attention",
    "varlen_attention_qk",
    "varlen_cross_attention",
]

_WHERE = {
    "BACKENDS": "registry",
    "BACKEND_NAMES": "registry",
    "available_backends": "registry",
    "get_backend": "registry",
    "Backend": "backend",
    "VarlenAttention": "backend",
    "flash_available": "flash",
    "varlen_attention": "varlen",
    "varlen_attention_qk": "varlen",
    "varlen_cross_attention": "varlen",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"knapformer.attention.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'knapformer.attention' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
