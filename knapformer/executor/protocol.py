"""The executor contract: the one interface every model and integration is written against.

A model calls its executor to move tokens and to attend; it never imports
``torch.distributed``. Two implementations keep the contract:

- :class:`~knapformer.executor.local.LocalExecutor`: one process, nothing moves (the
  reference every balanced run is compared with);
- :class:`~knapformer.distributed.SequenceBalancer`: a balancing group of ranks, planned once
  per step.

Legend: T tokens this rank contributes, R routed tokens it holds, h query heads, h_kv kv
heads, D head dim, Dv value dim, n sequences, M context rows.

===================  ===============================  =====================================
method               input                            output
===================  ===============================  =====================================
route                (T, *F) per tensor               (R, *F) per tensor
reverse_route        (R, *F) per tensor               (T, *F) per tensor, caller's order
attention            q (R, h, D), k/v (R, h_kv, ·)    (R, h, Dv)
pre_attn             q, k, v as for ``attention``     :class:`VarlenArgs` (one kernel call)
post_attn            the kernel's output on pre_attn  (R, h, Dv)
routed_positions     --                               (R,) sequence id, (R,) position
gather_sequences     (n_local, *F) per tensor         (n_group, *F) per tensor
route_context        (M_local, *F), lengths           :class:`RoutedContext`
cross_attention      q (R, h, D), k/v (M, h_kv, ·)    (R, h, Dv)
report_error         a message                        raised at the next agreement point
raise_everywhere     a message                        raises now (on every rank of a group)
===================  ===============================  =====================================
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, NoReturn, Protocol, runtime_checkable

import numpy as np
import torch

from knapformer.attention.bounds import host_bounds, to_device, upload
from knapformer.attention.varlen import varlen_cross_attention

__all__ = [
    "RoutedContext",
    "TokenExecutor",
    "VarlenArgs",
    "context_problem",
    "context_tensors",
    "cross_attend",
    "cross_attend_tensors",
    "cross_problem",
    "routed_context",
]


@runtime_checkable
class TokenExecutor(Protocol):
    """What a model may ask of its executor (see the module docstring for shapes)."""

    def route(self, x: torch.Tensor, *features: torch.Tensor, seq_lens: Sequence[int] | None = None, names=None):
        """Local tokens to their planned ranks; one tensor -> one tensor, several -> a tuple.
        ``seq_lens``: the layout of the tensors, checked against the plan; ``names``: what each
        tensor is, for error messages."""

    def reverse_route(self, y: torch.Tensor, *features: torch.Tensor, names=None):
        """Inverse of :meth:`route`."""

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False) -> torch.Tensor:
        """Attention of routed tokens within their own sequences."""

    def pre_attn(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool | None = None) -> VarlenArgs:
        """The arguments of one custom varlen kernel call (:class:`VarlenArgs`); pass the
        ``causal`` your kernel will use (it shapes the key segments under ring plans; None:
        the executor's default — the balancer's cost model's flag)."""

    def post_attn(self, o: torch.Tensor) -> torch.Tensor:
        """The custom kernel's output on :meth:`pre_attn`'s tensors -> (R, h, Dv)."""

    def routed_positions(self, device: torch.device | torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Per routed token: sequence id (ids of the whole group, rank-major) and position, on
        ``device`` or on the device of a tensor of the routed tokens (the form ``torch.compile``
        keeps in the graph)."""

    def gather_sequences(self, *per_seq: torch.Tensor, names=None) -> tuple[torch.Tensor, ...]:
        """Per-sequence rows of every rank, indexable by ``routed_positions()[0]``."""

    def route_context(self, context: torch.Tensor, lens: Sequence[int]) -> RoutedContext:
        """Each local sequence's context rows to the ranks holding its queries (once a step)."""

    def cross_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context: RoutedContext
    ) -> torch.Tensor:
        """Routed queries attend to their own sequence's routed context."""

    def report_error(self, message: str) -> None:
        """A problem only this rank can see, raised at the next agreement point."""

    def raise_everywhere(self, message: str) -> NoReturn:
        """Raise ``message`` now (on every rank of a balancing group)."""


class VarlenArgs(NamedTuple):
    """``pre_attn``'s result: the arguments of one varlen attention kernel call, in
    flash-attn's positional order, so ``flash_attn_varlen_func(*args, causal=c)`` or
    :func:`knapformer.attention.varlen_attention_qk` ``(*args, causal=c)`` runs it.

    What the kernel must do (the whole contract): for each segment i, the queries
    ``q[cu_seqlens_q[i]:cu_seqlens_q[i+1]]`` attend to the keys and values
    ``k/v[cu_seqlens_k[i]:cu_seqlens_k[i+1]]``; query head j uses kv head j // (h / h_kv)
    (GQA/MQA); with ``causal`` the mask is aligned to the *bottom right*: query t of a segment
    of n_q queries over n_k keys sees keys 0 … n_k − n_q + t (flash-attn ≥ 2.1's convention,
    ``torch.nn.attention.bias.causal_lower_right``; the ordinary causal mask when n_q = n_k).
    Segments have n_k ≥ n_q ≥ 1, except on a rank with nothing to compute: zero rows and one
    empty segment (bounds ``[0, 0]``, max lengths 0: flash-attn 2 refuses a batch of zero
    sequences and zero-fills an empty one). Without rings in the plan every segment is a whole sequence
    (the two bounds are equal, the same tensor); under a ring plan a member's queries are its
    block of the sequence and its keys the sequence's keys its queries may see (causal: one
    segment per contiguous query run, over the key prefix up to its end)."""

    q: torch.Tensor
    """(N, h', D) queries."""
    k: torch.Tensor
    """(M, h_kv', D) keys."""
    v: torch.Tensor
    """(M, h_kv', Dv) values."""
    cu_seqlens_q: torch.Tensor
    """(n + 1,) int32 query bounds."""
    cu_seqlens_k: torch.Tensor
    """(n + 1,) int32 key bounds."""
    max_seqlen_q: int
    max_seqlen_k: int

    @property
    def cu_seqlens(self) -> torch.Tensor:
        """The one bound of both, when queries and keys share it (no ring in the plan): the
        form of kernels that take a single ``cu_seqlens``. Raises when they differ."""
        if self.cu_seqlens_k is not self.cu_seqlens_q:
            raise ValueError(
                "pre_attn: queries and keys have different segments under this plan (ring groups): "
                "pass cu_seqlens_q and cu_seqlens_k to a kernel that takes both"
            )
        return self.cu_seqlens_q

    @property
    def max_len(self) -> int:
        """The max length when queries and keys share their bounds (see :attr:`cu_seqlens`)."""
        _ = self.cu_seqlens
        return self.max_seqlen_q


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
    """Inverse permutation of ``q_order``."""


def present_sequences(executor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(P,) the sequence ids (ascending) with routed tokens on this rank, and (R,) each routed
    token's row among them, on ``like``'s device: what per-sample work (AdaLN modulation) runs
    on, so that its cost follows the samples present here, not the group's. An executor that
    has a ``present_sequences(device)`` method (the balancer, :class:`LocalExecutor`) builds
    them on the host from its plan, with no device synchronisation; for any other,
    ``torch.unique`` of the routed sequence ids (one synchronisation on a GPU)."""
    own = getattr(executor, "present_sequences", None)
    if own is not None and not torch.compiler.is_compiling():
        return own(like.device)
    seq_id, _ = executor.routed_positions(like)
    present, slot = torch.unique(seq_id, sorted=True, return_inverse=True)
    return present, slot


def routed_context(rows: torch.Tensor, seq_ids, lens: Sequence[int], routed_seq_id) -> RoutedContext:
    """The :class:`RoutedContext` of context ``rows`` for sequences ``seq_ids`` (ascending) and
    this rank's routed queries (their sequence ids ``routed_seq_id``: best a host tensor or
    array, since the bounds are derived on the host and uploaded once, without a sync)."""
    device = rows.device
    ids = _host(seq_ids).reshape(-1)
    rid = _host(routed_seq_id).reshape(-1)
    slot = np.searchsorted(ids, rid)
    if rid.size and ((slot >= ids.size).any() or (ids[np.minimum(slot, max(ids.size - 1, 0))] != rid).any()):
        raise ValueError("routed tokens of a sequence without context")
    counts = np.bincount(slot, minlength=ids.size) if rid.size else np.zeros(ids.size, dtype=np.int64)
    order = inverse = None
    if rid.size > 1 and (rid[1:] < rid[:-1]).any():
        o = np.argsort(rid, kind="stable")
        inv = np.empty_like(o)
        inv[o] = np.arange(o.size)
        order, inverse = to_device(torch.from_numpy(o), device), to_device(torch.from_numpy(inv), device)
    lens = [int(n) for n in lens]
    cu_k = upload(np.concatenate([[0], np.cumsum(lens, dtype=np.int64)]), device)
    cu_q = upload(np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]), device)
    return RoutedContext(
        rows=rows, seq_ids=torch.from_numpy(ids), lens=lens, cu_k=cu_k, cu_q=cu_q, q_order=order, q_inverse=inverse
    )


def _host(x) -> np.ndarray:
    """``x`` (a list, an array, or a tensor) as an int64 host array."""
    if isinstance(x, torch.Tensor):
        x = x.detach()
        return (x if x.device.type == "cpu" else x.cpu()).numpy().astype(np.int64, copy=False)
    return np.asarray(x, dtype=np.int64)


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
    M = host_bounds(context.cu_k)[-1]
    if k.shape[0] != M or v.shape[0] != M:
        return f"k/v have {k.shape[0]}/{v.shape[0]} rows; the routed context has {M}"
    if k.shape[1] != v.shape[1] or k.shape[2] != q.shape[2] or q.shape[1] % max(k.shape[1], 1):
        return f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: heads or head_dim do not match"
    return ""


def cross_attend(q, k, v, context: RoutedContext, backend: str) -> torch.Tensor:
    """Cross-attention of routed queries over their sequences' routed context."""
    return cross_attend_tensors(q, k, v, context_tensors(context), backend)


def context_tensors(context: RoutedContext) -> list[torch.Tensor]:
    """The tensors cross-attention needs of a context: its bounds, and its query order (when the
    routed order is not grouped by sequence)."""
    order = [] if context.q_order is None else [context.q_order, context.q_inverse]
    return [context.cu_q, context.cu_k, *order]


def cross_attend_tensors(q, k, v, tensors: list[torch.Tensor], backend: str) -> torch.Tensor:
    """:func:`cross_attend` from :func:`context_tensors`."""
    cu_q, cu_k, *order = tensors
    if order:
        q = q.index_select(0, order[0])
    o = varlen_cross_attention(q, k, v, cu_q, cu_k, backend=backend)
    return o.index_select(0, order[1]) if order else o
