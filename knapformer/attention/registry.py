"""The attention backends, by name: one line each (torch-free, so the config can list them).

Adding a backend is one file holding a :class:`~knapformer.attention.backend.Backend` (its
varlen self-attention, optionally its cross-attention, when it can run, and whether ``auto``
may pick it) and one line in :data:`BACKENDS` below. Everything else — the config's and the
CLI's choices (:data:`BACKEND_NAMES`), the ``auto`` rule, :func:`available_backends`, the
conformance test — is derived from this table.
"""

from __future__ import annotations

import importlib
from functools import cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the table itself needs no torch
    from knapformer.attention.backend import Backend

__all__ = ["BACKENDS", "BACKEND_NAMES", "available_backends", "get_backend", "resolve_backend"]

BACKENDS: dict[str, str] = {
    "sdpa": "knapformer.attention.sdpa:BACKEND",
    "sdpa_mask": "knapformer.attention.sdpa_mask:BACKEND",
    "flash": "knapformer.attention.flash:BACKEND",
    "flash2_rules": "knapformer.testing.flash_rules:BACKEND",
}
"""Backend name -> ``module:attribute`` of its :class:`Backend` (imported on first use).
``flash2_rules`` is knapformer's flash-attn code on a CPU stand-in that enforces flash-attn
2's argument rules (:mod:`knapformer.testing.flash_rules`): for tests; ``auto`` never picks it."""

BACKEND_NAMES: tuple[str, ...] = ("auto", *BACKENDS)
"""Every value ``attn_backend`` accepts: the backends and ``auto`` (the best usable one)."""


@cache
def get_backend(name: str) -> Backend:
    """The backend registered as ``name`` (its module is imported on first use)."""
    try:
        target = BACKENDS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown attention backend {name!r}; choose one of {sorted(BACKENDS)} or 'auto'") from None
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def resolve_backend(name: str, q) -> Backend:
    """``name``'s backend, or for ``auto`` the usable backend of highest ``auto_priority`` for
    tensors like ``q`` (its device and dtype)."""
    if name != "auto":
        return get_backend(name)
    usable = [b for b in map(get_backend, BACKENDS) if b.auto_priority is not None and b.unavailable(q) is None]
    return max(usable, key=lambda b: b.auto_priority)


def available_backends(device) -> dict[str, str | None]:
    """Backend name -> None if usable for tensors on ``device``, else the reason it is not."""
    import torch

    probe = torch.empty(0, 1, 1, device=device, dtype=torch.bfloat16 if torch.device(device).type == "cuda" else None)
    return {name: get_backend(name).unavailable(probe) for name in BACKENDS}
