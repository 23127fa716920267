"""The family seam's attention plumbing: installing a family's packed processor on one model
instance, and the reshapes and rotary embedding every packed processor applies.

A packed processor computes q/k/v with the stock projections and norms of the module it is
set on, applies the stock rotary embedding, and attends within each sample through the
executor (:meth:`~knapformer.integrations.packing.Routed.attention` in joint order); a call
without the family's packed metadata goes to the processor the module had (the stock one).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from typing import ClassVar

import torch

__all__ = ["PackedProcessor", "heads", "install", "rotate"]


class PackedProcessor:
    """Base of a family's packed processor: ``stock`` names (``"module:Class"``) the diffusers
    processor that calls without packed metadata go to; :meth:`stock_module` is its module
    (where the family's stock projection helpers live)."""

    stock: ClassVar[str]

    def __init__(self) -> None:
        self._stock = getattr(self.stock_module(), self.stock.partition(":")[2])()

    @classmethod
    def stock_module(cls):
        return importlib.import_module(cls.stock.partition(":")[0])


def install(modules: Iterable, cls: type, make: Callable | None = None) -> None:
    """Give every attention module in ``modules`` a ``cls`` processor unless it has one (checked
    every call: a module whose processor was replaced since, e.g. by ``set_attn_processor``,
    gets one again). ``make(module)`` builds it from the module (default: one ``cls()`` shared
    by all)."""
    shared = None
    for attn in modules:
        if isinstance(attn.processor, cls):
            continue
        if make is not None:
            attn.set_processor(make(attn))
            continue
        shared = shared or cls()
        attn.set_processor(shared)


def heads(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """(T, 1, H·Dh) projections (one token per batch row) -> (T, H, Dh)."""
    return t.unflatten(-1, (num_heads, -1)).squeeze(1)


def rotate(x: torch.Tensor, rope) -> torch.Tensor:
    """diffusers' ``apply_rotary_emb`` on (T, H, Dh) with the token dimension as the sequence
    (it cannot reshape zero tokens: those, and ``rope`` None, pass unchanged)."""
    from diffusers.models.embeddings import apply_rotary_emb

    if rope is None or not x.shape[0]:
        return x
    return apply_rotary_emb(x[None], rope, sequence_dim=1)[0]
