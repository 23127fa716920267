"""The balancer under ``torch.compile``: its attention kinds and its routed positions as opaque
custom operators (see :mod:`knapformer.executor.opaque` for why and how).

- ``balanced``: :meth:`SequenceBalancer.attention`'s eager code (agreement, pre exchange,
  kernels, post exchange) inside ``knapformer::attend``;
- ``balanced_cross``: :meth:`SequenceBalancer.cross_attention`'s, given the context's tensors;
- ``knapformer::routed_positions``: this step's (sequence id, position) of each routed token,
  shaped like the routed tokens a caller passes, so the compiled graph never holds the plan.

Everything else the balancer does once per step (``plan``, ``route``, ``reverse_route``,
``gather_sequences``, ``route_context``) runs eagerly at a graph break.
"""

from __future__ import annotations

import torch

from knapformer.executor.opaque import lookup, register_kind

__all__ = ["routed_positions"]


def _balanced(bal, q, k, v, extra, causal, backend):
    return bal._attention_eager(q, k, v, causal)


def _balanced_cross(bal, q, k, v, extra, causal, backend):
    from knapformer.distributed.cross import cross_attention_tensors

    return cross_attention_tensors(bal, q, k, v, extra)


register_kind("balanced", _balanced)
register_kind("balanced_cross", _balanced_cross)


@torch.library.custom_op("knapformer::routed_positions", mutates_args=())
def _routed_positions(like: torch.Tensor, owner: int) -> tuple[torch.Tensor, torch.Tensor]:
    seq_id, pos = lookup(owner)._positions_eager(like.device)
    return seq_id.clone(), pos.clone()


@_routed_positions.register_fake
def _(like, owner):
    n = like.shape[0]
    return like.new_empty((n,), dtype=torch.int64), like.new_empty((n,), dtype=torch.int64)


def routed_positions(like: torch.Tensor, owner: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The routed tokens' (sequence id, position), one per row of ``like``."""
    return torch.ops.knapformer.routed_positions(like, owner)
