"""Per-sequence context (a sample's text) sent to the ranks that hold that sample's queries.

Cross-attention (Wan's ``attn2``) needs, on every rank holding tokens of a sequence, the
whole context of that sequence — but only there. From the plan, which every rank shares,
each rank derives the (destination, sequence) pairs: a pair for every rank that holds at
least one routed token of the sequence. The owner of the sequence (the rank it was loaded
on) sends its context rows once to each such rank; one ``all_to_all_single`` per step, not
per layer, and none at all when no context leaves its owner (every sequence whole at
home). Received rows come ordered by source rank then sequence id, i.e. by global sequence
id (ids are rank-major), which is the order :class:`~knapformer.executor.RoutedContext`
wants. The exchange is differentiable: a context sent to k ranks gets the sum of the k
gradients back (autograd sums the duplicated rows of the send-side ``index_select``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from knapformer.distributed.spec import concat_ranges
from knapformer.plan import Plan
from knapformer.plan.seqindex import DST, LEN

__all__ = ["ContextRoute", "build_context_route"]


@dataclass(frozen=True)
class ContextRoute:
    """One rank's share of a step's context exchange."""

    send_rows: np.ndarray
    """Rows of the local context to send, grouped by destination, then by sequence id."""
    send_splits: list[int]
    recv_splits: list[int]
    seq_ids: np.ndarray
    """Sequences whose context this rank receives (ascending global ids)."""
    lens: np.ndarray
    """Context rows of each of ``seq_ids``."""
    moves: bool
    """Some context leaves its owner somewhere in the group (the same on every rank)."""


def build_context_route(plan: Plan, rank: int, ctx_lens: np.ndarray) -> ContextRoute:
    """The exchange for ``ctx_lens`` (context rows of every sequence, global id order)."""
    S = plan.num_ranks
    index = plan.index
    ctx_lens = np.asarray(ctx_lens, dtype=np.int64)
    owner = np.repeat(np.arange(S, dtype=np.int64), index.counts)
    ch = plan.chunks
    live = ch[:, LEN] > 0
    pairs = np.unique(np.stack([ch[live, DST], plan.chunk_gid[live]], axis=1).astype(np.int64), axis=0)
    pairs = pairs.reshape(-1, 2)  # (destination, sequence), sorted by destination then sequence
    moves = bool(np.any(owner[pairs[:, 1]] != pairs[:, 0])) if pairs.size else False
    first = index.first[rank]
    local_lens = ctx_lens[first : index.first[rank + 1]]
    offsets = np.cumsum(local_lens) - local_lens
    mine = pairs[owner[pairs[:, 1]] == rank]
    send_rows = concat_ranges(offsets[mine[:, 1] - first], ctx_lens[mine[:, 1]])
    send = np.bincount(mine[:, 0], weights=ctx_lens[mine[:, 1]], minlength=S).astype(np.int64)
    recv_seqs = pairs[pairs[:, 0] == rank, 1]
    recv = np.bincount(owner[recv_seqs], weights=ctx_lens[recv_seqs], minlength=S).astype(np.int64)
    return ContextRoute(
        send_rows=send_rows,
        send_splits=send.tolist(),
        recv_splits=recv.tolist(),
        seq_ids=recv_seqs,
        lens=ctx_lens[recv_seqs],
        moves=moves,
    )
