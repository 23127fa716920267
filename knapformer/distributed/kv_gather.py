"""Ring groups through one custom kernel call: keys and values all-gathered over the ring.

``pre_attn`` hands one varlen kernel call to the user's kernel, and ring attention (rounds of
K/V blocks merged by their log-sum-exp) is not what one call of such a kernel computes. So on
this path a ring group (k = u·r members as r sub-groups of u) is Ulysses inside each
sub-group as for ``attention`` — member t of sub-group s holds its h/u heads of the
sub-group's *block* of each sequence — and then gathers from its r − 1 ring peers (the
members t of the other sub-groups, which hold the same heads) their blocks' keys and values.
Its queries stay where they are; its keys are the keys of the sequence its queries may see.
One varlen call with separate query and key bounds (:class:`~knapformer.executor.VarlenArgs`)
then computes what the ring computes:

- not causal: one segment per sequence — the member's block of queries over all L keys (in
  position order);
- causal: one segment per contiguous run of the block's query positions (the zigzag cut gives
  two per sequence, half-blocks s and 2r − 1 − s, or one where they meet) over the key prefix
  up to the run's end, under the bottom-right-aligned causal mask. The earlier run's prefix
  is then held twice: L·(2r + 1)/(2r) key rows per sequence instead of L.

One exchange per layer with this rank's ring peers (point-to-point, :mod:`.exchange`) moves
every ring entry's blocks at once (each member sends its own block to each ring peer; counts in
elements, so entries of different widths share it; a rank in no ring exchanges nothing). Its
backward is the opposite exchange: every gathered block's key/value gradients go back to the block's owner,
where they add up with its own (a reduce-scatter over the ring), in the activations' dtype.
Memory per member and ring sequence: its block plus the gathered keys and values of its kv
heads (≈ L rows of h_kv/u heads × (D + Dv)), where the ring holds a few blocks of L/r —
:mod:`knapformer.plan.memory` counts it against ``max_tokens_per_rank``.

Legend: r ring sub-groups, s this member's sub-group, n an entry's sequences, L tokens.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import numpy as np
import torch

import knapformer.distributed.trace as trace
from knapformer.attention.bounds import to_device, upload
from knapformer.distributed.exchange import Peers, exchange
from knapformer.distributed.spec import GroupEntry, RouteSpec
from knapformer.distributed.ulysses.exchange import AttnBatch, UlyssesCall

__all__ = ["EntryKeys", "entry_keys", "gather_kv", "join_backward"]


@dataclass(frozen=True)
class EntryKeys:
    """One ring entry's kernel segments on this member, in rows (any head configuration)."""

    block_rows: tuple[int, ...]
    """Rows of each sub-group's block (all the entry's sequences), in sub-group order."""
    key_rows: np.ndarray
    """Rows of the blocks stacked in sub-group order, in the kernel's key order (a row appears
    once per segment that sees it)."""
    q_lens: tuple[int, ...]
    """Query segments: consecutive rows of this member's block, in order (they cover it)."""
    k_lens: tuple[int, ...]
    """Key rows of each segment."""


@functools.lru_cache(maxsize=256)
def entry_keys(e: GroupEntry, causal: bool) -> EntryKeys:
    """The segments of ring entry ``e`` (``e.ring`` > 1) on this member (see module
    docstring); depends on the plan only, so computed once per plan."""
    r, s = e.ring, e.ring_pos
    blocks = np.asarray(e.blocks, dtype=np.int64).reshape(r, -1)
    rows = blocks.sum(axis=1)
    base = np.concatenate([[0], np.cumsum(rows)[:-1]])
    first = np.concatenate([np.zeros((r, 1), dtype=np.int64), np.cumsum(blocks, axis=1)], axis=1)
    keys, q_lens = [], []
    for i, L in enumerate(e.seq_lens):
        if blocks[s, i] == 0:  # no query of this member: no segment, its keys are not needed
            continue
        row_of = np.empty(L, dtype=np.int64)  # position -> row of the stacked blocks
        for j in range(r):
            row = base[j] + first[j, i]
            for start, n in e.runs[j][i]:
                row_of[start : start + n] = np.arange(row, row + n)
                row += n
        if not causal:
            q_lens.append(int(blocks[s, i]))
            keys.append(row_of)
            continue
        for start, n in e.runs[s][i]:  # runs are consecutive rows of the block, in order
            q_lens.append(int(n))
            keys.append(row_of[: start + n])
    key_rows = np.concatenate(keys) if keys else np.zeros(0, dtype=np.int64)
    return EntryKeys(tuple(int(x) for x in rows), key_rows, tuple(q_lens), tuple(len(k) for k in keys))


def _bounds(lens, device) -> torch.Tensor:
    return upload(np.concatenate([[0], np.cumsum(lens, dtype=np.int64)]), device)


def _entry_tensors(spec: RouteSpec, e: GroupEntry, causal: bool, device) -> tuple:
    """``entry_keys`` as tensors on ``device`` (cached on the spec: every layer reuses them)."""
    key = ("kv_gather", e.group, causal, str(device))
    if key not in spec.cache:
        lay = entry_keys(e, causal)
        spec.cache[key] = (
            lay,
            to_device(torch.from_numpy(lay.key_rows), device),
            _bounds(lay.q_lens, device),
            _bounds(lay.k_lens, device),
        )
    return spec.cache[key]


class _GatherKV(torch.autograd.Function):
    """The flat send buffer (own blocks, once per ring peer) -> the received blocks, and an
    empty *token*: a rank whose kernel does not use what it received still runs the backward
    exchange its ring peers are in, through the token (:func:`join_backward`)."""

    @staticmethod
    def forward(ctx, peers: Peers, group, send):  # type: ignore[override]
        ctx.peers, ctx.group = peers, group
        with trace.span(f"{trace.EXCHANGE}.kv_gather"):
            recv = exchange(send, peers, group, "kv_gather")
        return recv, send.new_empty(0)

    @staticmethod
    def backward(ctx, grad_recv, grad_token):  # type: ignore[override]
        with trace.span(f"{trace.EXCHANGE}.kv_gather.backward"):
            grad = exchange(grad_recv.contiguous(), ctx.peers.reversed(), ctx.group, "kv_gather backward")
        return None, None, grad


class _Join(torch.autograd.Function):
    """``x`` unchanged; its backward also gives the token a (empty) gradient."""

    @staticmethod
    def forward(ctx, x, token):  # type: ignore[override]
        ctx.token_shape = token.shape
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad, grad.new_zeros(ctx.token_shape)


def join_backward(x: torch.Tensor, token: torch.Tensor | None) -> torch.Tensor:
    """``x``, such that its backward also runs the K/V gather's backward exchange (``token``:
    :attr:`UlyssesCall.kv_token`; None: ``x`` as it is)."""
    if token is None or not isinstance(x, torch.Tensor):
        return x
    return _Join.apply(x, token)


def _gather_peers(spec: RouteSpec, call: UlyssesCall, ring: list[int], widths: tuple[int, ...]):
    """The gather's exchange (elements per ring peer, both ways) and each received block's
    (slot, sub-group, elements), in buffer order; cached per plan and head widths."""
    key = ("kv_gather peers", tuple(ring), widths)
    if key not in spec.cache:
        sends, recvs = [], []
        for slot, i in enumerate(ring):
            e = call.batches[i].ring
            for j, peer in enumerate(e.ring_peers):
                if j != e.ring_pos:
                    sends.append((peer, slot))
                    recvs.append((peer, slot, j))
        # both sides of a pair list their common entries in the global group order
        sends.sort(key=lambda t: t[0])
        recvs.sort(key=lambda t: t[0])
        rows = [sum(call.batches[i].ring.blocks[call.batches[i].ring.ring_pos]) for i in ring]
        send_parts = [(peer, rows[slot] * widths[slot]) for peer, slot in sends]
        pieces = [(slot, j, sum(call.batches[ring[slot]].ring.blocks[j]) * widths[slot]) for _, slot, j in recvs]
        recv_parts = [(peer, n) for (peer, _, _), (_, _, n) in zip(recvs, pieces)]
        spec.cache[key] = (Peers.from_parts(send_parts, recv_parts, spec.rank), [s for _, s in sends], pieces)
    return spec.cache[key]


def gather_kv(call: UlyssesCall, spec: RouteSpec, group, causal: bool) -> UlyssesCall:
    """This rank's attention batches with every ring batch completed for one kernel call: its
    queries as they are, its keys/values gathered from its ring peers and laid out in segments
    (``AttnBatch.cu_seqlens_k``). Point-to-point with this rank's ring peers only; a rank in
    no ring group calls nothing (its call is returned as it is)."""
    ring = [i for i, b in enumerate(call.batches) if b.ring is not None]
    if not ring:
        return call
    anchor = call.anchor
    assert anchor is not None, "a ring entry always has a pre-attention exchange"
    device = anchor.device
    lays, own = [], []
    for i in ring:
        b = call.batches[i]
        lays.append(_entry_tensors(spec, b.ring, causal, device))
        own.append(torch.cat([b.k.flatten(1), b.v.flatten(1)], dim=1))
    peers, send_slots, pieces = _gather_peers(spec, call, ring, tuple(o.shape[1] for o in own))
    send = torch.cat([own[slot].reshape(-1) for slot in send_slots]) if send_slots else anchor
    recv, token = _GatherKV.apply(peers.without(call.skip), group, send)
    sizes = [n for _, _, n in pieces]
    got = dict(zip(((slot, j) for slot, j, _ in pieces), torch.split(recv, sizes) if sizes else ()))
    batches = list(call.batches)
    for slot, i in enumerate(ring):
        b = batches[i]
        e = b.ring
        lay, key_rows, cu_q, cu_k = lays[slot]
        w = own[slot].shape[1]
        blocks = [own[slot] if j == e.ring_pos else got[(slot, j)].view(-1, w) for j in range(e.ring)]
        kv = torch.cat(blocks).index_select(0, key_rows)
        hkv, d, dv = b.k.shape[1], b.k.shape[2], b.v.shape[2]
        k, v = torch.split(kv, [hkv * d, hkv * dv], dim=1)
        batches[i] = AttnBatch(
            b.degree,
            b.q,
            k.unflatten(1, (hkv, d)),
            v.unflatten(1, (hkv, dv)),
            cu_q,
            max(lay.q_lens, default=0),
            None,
            cu_seqlens_k=cu_k,
            max_len_k=max(lay.k_lens, default=0),
        )
    return dataclasses.replace(call, batches=batches, anchor=join_backward(anchor, token), kv_token=token)
