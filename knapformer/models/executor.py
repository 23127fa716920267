"""The handle a model calls for token movement and attention.

``SequenceBalancer`` (``knapformer.distributed``) implements it over torch.distributed; the
:class:`LocalExecutor` here implements it for one process with no balancing, so the same
model code runs both ways and the models never import torch.distributed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NoReturn, Protocol

import torch

from knapformer.attention import varlen_attention, varlen_cross_attention

__all__ = [
    "LocalExecutor",
    "RoutedContext",
    "TokenExecutor",
    "context_problem",
    "local_positions",
    "raise_everywhere",
    "routed_context",
]


class TokenExecutor(Protocol):
    def route(self, x: torch.Tensor, *features: torch.Tensor, seq_lens: Sequence[int] | None = None): ...
    def reverse_route(self, y: torch.Tensor, *features: torch.Tensor): ...
    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False) -> torch.Tensor: ...
    def routed_positions(self, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]: ...
    def gather_sequences(self, *per_seq: torch.Tensor) -> tuple[torch.Tensor, ...]: ...
    def route_context(self, context: torch.Tensor, lens: Sequence[int]) -> RoutedContext: ...
    def cross_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context: RoutedContext
    ) -> torch.Tensor: ...


@dataclass(eq=False)
class RoutedContext:
    """Per-sequence context (e.g. a sample's text) on the rank that holds that sequence's
    queries, from :meth:`TokenExecutor.route_context` (once per step, every layer reuses it).

    ``rows`` are the contexts of ``seq_ids`` concatenated in that order; project them to each
    layer's keys/values and pass those to :meth:`TokenExecutor.cross_attention`."""

    rows: torch.Tensor
    """(M, *F) context rows of the sequences in ``seq_ids``."""
    seq_ids: torch.Tensor
    """(n,) int64: the sequences (ids as in ``routed_positions()[0]``), ascending."""
    lens: list[int]
    """Context rows of each sequence in ``seq_ids``."""
    cu_k: torch.Tensor
    """(n + 1,) int32 bounds of each sequence's context in ``rows``."""
    cu_q: torch.Tensor
    """(n + 1,) int32 bounds of each sequence's queries once grouped by sequence."""
    q_order: torch.Tensor | None
    """Routed rows in sequence order (None: the routed order is already grouped)."""
    q_inverse: torch.Tensor | None


def routed_context(rows: torch.Tensor, seq_ids, lens: Sequence[int], routed_seq_id: torch.Tensor) -> RoutedContext:
    """The :class:`RoutedContext` of context ``rows`` for sequences ``seq_ids`` (ascending) and
    this rank's routed queries (their sequence ids ``routed_seq_id``)."""
    device = rows.device
    ids = torch.as_tensor(seq_ids, dtype=torch.int64).reshape(-1).cpu()
    rid = routed_seq_id.cpu()
    slot = torch.searchsorted(ids, rid)
    if rid.numel() and (
        bool((slot >= ids.numel()).any()) or bool((ids[slot.clamp(max=max(ids.numel() - 1, 0))] != rid).any())
    ):
        raise ValueError("routed tokens of a sequence without context")
    counts = torch.bincount(slot, minlength=ids.numel()) if rid.numel() else torch.zeros(ids.numel(), dtype=torch.int64)
    order = inverse = None
    if rid.numel() > 1 and bool((rid[1:] < rid[:-1]).any()):
        order = torch.sort(rid, stable=True).indices
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel())
        order, inverse = order.to(device), inverse.to(device)
    lens = [int(n) for n in lens]
    cu_k = torch.tensor([0, *torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)
    cu_q = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).to(torch.int32)
    return RoutedContext(rows=rows, seq_ids=ids, lens=lens, cu_k=cu_k, cu_q=cu_q, q_order=order, q_inverse=inverse)


def context_problem(context, lens, num_seqs: int) -> str:
    """Why ``context``/``lens`` cannot be this rank's per-sequence context ("" if they can)."""
    if not isinstance(context, torch.Tensor) or context.dim() == 0:
        return "context must be a tensor (rows, *features)"
    try:
        lens = [int(n) for n in lens]
    except (TypeError, ValueError):
        return f"context lengths must be ints, got {lens!r}"
    if len(lens) != num_seqs:
        return f"{len(lens)} context lengths for {num_seqs} sequences"
    if any(n < 0 for n in lens):
        return f"context lengths must be >= 0, got {lens[:8]}"
    if sum(lens) != context.shape[0]:
        return f"context has {context.shape[0]} rows, its lengths sum to {sum(lens)}"
    return ""


def cross_problem(q, k, v, context: RoutedContext, routed: int) -> str:
    """Why q/k/v cannot be cross-attended over ``context`` ("" if they can)."""
    if not all(isinstance(t, torch.Tensor) and t.dim() == 3 for t in (q, k, v)):
        return "q, k, v must be (rows, heads, head_dim) tensors"
    if q.shape[0] != routed:
        return f"q has {q.shape[0]} rows; routed tokens: {routed}"
    M = int(context.cu_k[-1])
    if k.shape[0] != M or v.shape[0] != M:
        return f"k/v have {k.shape[0]}/{v.shape[0]} rows; the routed context has {M}"
    if k.shape[1] != v.shape[1] or k.shape[2] != q.shape[2] or q.shape[1] % max(k.shape[1], 1):
        return f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: heads or head_dim do not match"
    return ""


def cross_attend(q, k, v, context: RoutedContext, backend: str) -> torch.Tensor:
    """Cross-attention of routed queries over their sequences' routed context."""
    if context.q_order is not None:
        q = q.index_select(0, context.q_order)
    o = varlen_cross_attention(q, k, v, context.cu_q, context.cu_k, backend=backend)
    return o if context.q_inverse is None else o.index_select(0, context.q_inverse)


def raise_everywhere(executor, error: str) -> NoReturn:
    """A problem with this rank's inputs found before the step's first exchange: with a
    balancer, raise it on every rank of the group (at the agreement of ``route``, which the
    other ranks are entering) instead of only here, where the others would wait in the
    collective; a plain ``ValueError`` for a local executor."""
    report = getattr(executor, "report_error", None)
    if report is not None:
        report(error)
        executor.route(torch.zeros(0, 1))  # its agreement raises on every rank
    raise ValueError(error)


def local_positions(seq_lens: Sequence[int], device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(seq id, position) of each token of sequences packed in order."""
    lens = torch.as_tensor(list(seq_lens), dtype=torch.int64)
    seq_id = torch.repeat_interleave(torch.arange(lens.numel()), lens)
    starts = torch.cumsum(lens, 0) - lens
    pos = torch.arange(int(lens.sum())) - starts[seq_id]
    return seq_id.to(device), pos.to(device)


class LocalExecutor:
    """No balancing: tokens stay in place; attention runs over this process's sequences."""

    def __init__(self, seq_lens: Sequence[int], attn_backend: str = "auto") -> None:
        self.seq_lens = [int(v) for v in seq_lens]
        self.attn_backend = attn_backend
        self._cu = torch.tensor(
            [0, *torch.tensor(self.seq_lens, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32
        )

    def route(self, x, *features, seq_lens=None):
        if seq_lens is not None and [int(n) for n in seq_lens] != self.seq_lens:
            raise ValueError(f"tensors laid out as sequences {list(seq_lens)}, this executor has {self.seq_lens}")
        return x if not features else (x, *features)

    def reverse_route(self, y, *features):
        return y if not features else (y, *features)

    def attention(self, q, k, v, causal: bool = False):
        return varlen_attention(
            q, k, v, self._cu.to(q.device), max(self.seq_lens, default=0), causal=causal, backend=self.attn_backend
        )

    def routed_positions(self, device=None):
        return local_positions(self.seq_lens, device)

    def gather_sequences(self, *per_seq):
        return tuple(per_seq)

    def route_context(self, context: torch.Tensor, lens: Sequence[int]) -> RoutedContext:
        """Every sequence is here: its context stays (checked against the sequences)."""
        error = context_problem(context, lens, len(self.seq_lens))
        if error:
            raise ValueError(f"route_context: {error}")
        seq, _ = local_positions(self.seq_lens, context.device)
        return routed_context(context, torch.arange(len(self.seq_lens)), lens, seq)

    def cross_attention(self, q, k, v, context: RoutedContext):
        error = cross_problem(q, k, v, context, sum(self.seq_lens))
        if error:
            raise ValueError(f"cross_attention: {error}")
        return cross_attend(q, k, v, context, self.attn_backend)
